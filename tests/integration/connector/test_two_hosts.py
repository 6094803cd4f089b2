"""Two hosts for real: a trainer in its own network namespace reaches the stack only through a
veth pair, and gets every sample once over the Mooncake Transfer Engine (TCP) and over
ZeroMQ bytes (CURVE), with nothing left in the spool.

Host A is this test's own network namespace: vLLM (CPU build) and the sidecar, one engine
start for both transports; the sidecar's remote endpoint and its Mooncake engine are on A's
end of the link. Host B is a namespace created here with only loopback and the other end of the
link; the trainer runs there (``ip netns exec``) with the spool hidden under an empty tmpfs in
its own mount namespace, so it cannot read the files even though both "hosts" share a disk.
Needs root and ``ip netns`` (CI runs as root): where they are missing the test fails saying so.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from hsstream import launch
from hsstream.devstack import free_port
from tests.integration.conftest import start_stack, stop_stack, submit
from tests.integration.server.test_reliability import read_log, token_samples, wait_done

HERE = Path(__file__).resolve().parent
N = 8


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}`: {p.stderr.strip() or p.returncode}")


class Link:
    """Namespace ``ns`` (host B) joined to this namespace (host A) by a veth pair."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns, self.a_if, self.b_if = f"hsstream-b-{tag}", f"hsa{tag}", f"hsb{tag}"
        octet = 16 + os.getpid() % 200
        self.a_ip, self.b_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"

    def up(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.a_if, "type", "veth", "peer", "name", self.b_if)
        _ip("link", "set", self.b_if, "netns", self.ns)
        _ip("addr", "add", f"{self.a_ip}/30", "dev", self.a_if)
        _ip("link", "set", self.a_if, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.b_ip}/30", "dev", self.b_if)
        _ip("-n", self.ns, "link", "set", self.b_if, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Always, even half set up: deleting the namespace deletes its end of the pair (and so the pair)."""
        for args in (("netns", "del", self.ns), ("link", "del", self.a_if)):
            subprocess.run(["ip", *args], capture_output=True, timeout=30)

    def run_in_b(self, cmd: list[str], hide: Path, timeout: float) -> subprocess.CompletedProcess:
        """``cmd`` on host B, with ``hide`` (the spool) under an empty tmpfs of B's own mounts."""
        script = 'mount -t tmpfs -o size=1m,mode=0700 hsstream-host-b "$1" && shift && exec "$@"'
        return subprocess.run(["ip", "netns", "exec", self.ns, "sh", "-c", script, "sh", str(hide), *cmd],
                              env=launch.child_env(), cwd=launch.repo_root(), capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def two_hosts(tiny_model):

    link = Link()
    try:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise RuntimeError("needs root and iproute2's `ip`")
        link.up()
    except Exception as e:  # noqa: BLE001
        link.down()
        pytest.fail(f"network namespaces are not available here ({e}): the two-host test cannot run", pytrace=False)
    state = Path(tempfile.mkdtemp(prefix="hsstream-2h-"))
    keys = state / "keys"
    # as `hsstream keys` writes them: the sidecar and the stream refuse a secret others can read
    from connector.contract.curve_keys import write_key_pair

    write_key_pair(keys, "server")
    write_key_pair(keys / "clients", "trainer")
    port = free_port()
    st = None
    try:
        st = start_stack(tiny_model, [2, 6, 9, 12], prefix="hsstream-2h-", env={
            "HSSTREAM_REMOTE_ENDPOINT": f"tcp://{link.a_ip}:{port}",
            "HSSTREAM_CURVE_SERVER_SECRET_FILE": str(keys / "server.key_secret"),
            "HSSTREAM_CURVE_CLIENTS_DIR": str(keys / "clients"),
            "HSSTREAM_MOONCAKE_HOSTNAME": link.a_ip,
            "HSSTREAM_LEDGER_PATH": str(state / "ledger.sqlite"),
        })  # fmt: skip
        st.remote, st.keys, st.link, st.state = f"tcp://{link.a_ip}:{port}", keys, link, state
        yield st
    finally:
        if st is not None:
            stop_stack(st)
        link.down()
        shutil.rmtree(state, ignore_errors=True)


def _probe_from_b(st, host: str, port: int) -> bool:
    code = ("import socket,sys\ns=socket.socket();s.settimeout(3)\n"
            f"sys.exit(0 if s.connect_ex(({host!r}, {port})) == 0 else 1)")  # fmt: skip
    return st.link.run_in_b([sys.executable, "-c", code], st.spool, 30).returncode == 0


def test_host_b_reaches_host_a_only_through_the_link(two_hosts):
    st = two_hosts
    port = int(st.remote.rsplit(":", 1)[1])
    assert _probe_from_b(st, st.link.a_ip, port)  # the sidecar's remote endpoint, over the veth pair
    assert not _probe_from_b(st, "127.0.0.1", st.api_port)  # A's loopback (REST, vLLM) is not B's
    assert not _probe_from_b(st, "127.0.0.1", port)
    with socket.create_connection(("127.0.0.1", st.api_port), timeout=3):
        pass  # while from A itself it answers


@pytest.mark.parametrize("transport", ["mooncake", "zmq"])
def test_every_sample_once_over_the_link(two_hosts, transport):
    st = two_hosts
    samples = token_samples(N, 24, seed={"mooncake": 11, "zmq": 12}[transport])
    job = submit(st, samples)
    before = httpx.get(f"{st.api}/v1/stats", timeout=10, headers=st.headers).json()["delivery"]
    log = st.state / f"trainer-{transport}.jsonl"
    p = st.link.run_in_b(
        [sys.executable, str(HERE.parent / "trainer_client" / "trainer_proc.py"), "--endpoint", st.remote, "--spool", str(st.spool),
         "--log", str(log), "--jobs", job, "--transport", transport,
         "--server-key", str(st.keys / "server.key"), "--client-cert", str(st.keys / "clients" / "trainer.key_secret")],
        st.spool, 300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    lines = read_log(log)
    used = [ln for ln in lines if "used" in ln]
    acked = [ln["acked"] for ln in lines if "acked" in ln]
    assert len(used) == N and len({u["used"] for u in used}) == N, "a sample delivered twice or missing"
    assert sorted(acked) == sorted(u["used"] for u in used)
    by_label = {u["label"]: u for u in used}
    for smp in samples:  # the bytes the trainer checked are the ones vLLM made for these tokens
        assert by_label[smp["id"]]["ids"] == smp["token_ids"]
        assert by_label[smp["id"]]["hs"][1] == [24, 4, 128]
    end = lines[-1]
    assert end["end"] == N and end["stats"]["invalid"] == 0 and end["stats"]["duplicates"] == 0
    c = wait_done(st, job)["counts"]
    assert c["consumed"] == N and c["failed"] == 0, c
    after = httpx.get(f"{st.api}/v1/stats", timeout=10, headers=st.headers).json()["delivery"]
    assert after[f"delivered_{transport}"] - before[f"delivered_{transport}"] == N
    other = {"mooncake": "zmq", "zmq": "mooncake"}[transport]
    assert after[f"delivered_{other}"] == before[f"delivered_{other}"]
    deadline = time.monotonic() + 5
    while st.spool_files() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert st.spool_files() == []  # deleted by the sidecar on RECEIVED, after the trainer held the bytes
