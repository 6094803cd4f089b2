"""Nobody is read, parsed or served before they are let in (issue 40): a real `hsstream serve`
(uvicorn, no vLLM behind it), started without ``HSSTREAM_API_TOKEN`` on loopback, with a 1 s body
timeout and at most 2 bodies per client.

- the sidecar makes its own token (0600, in its run dir) and our clients find it there;
- a stranger's body is answered 401 from its head, before any of it is read, spooled or parsed,
  and what it goes on sending is drained, so it reads its 401 rather than a reset;
- an over-limit body gets a 413 the client reads (a 17 MiB JSON body once saw a reset);
- a body that stalls gets 408; one client has at most 2 bodies in progress (429 beyond);
- a row with more text than its token limit can hold is refused before it is tokenised;
- a second sidecar on the same spool or port stops before it touches the first one's ledger,
  spool or sockets, naming it.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from connector import protocol as P
from connector.contract.api_token import read_token
from hsstream.devstack import free_port
from tests.integration.conftest import sidecar_without_vllm

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def sidecar(tiny_model):
    with sidecar_without_vllm(tiny_model, "", "hsstream-gate-", HSSTREAM_HTTP_BODY_TIMEOUT_S="1",
                              HSSTREAM_MAX_UPLOADS_PER_CLIENT="2") as sc:  # no token set  # fmt: skip
        yield sc


def run_dir(sc) -> Path:  # noqa: ANN001
    return Path(sc.env["HSSTREAM_RUN_DIR"])


def auth(sc) -> dict[str, str]:  # noqa: ANN001
    token = read_token(run_dir(sc))
    assert token, "the sidecar made no token of its own"
    return {"authorization": f"Bearer {token}"}


def head(port: int, path: str, headers: dict[str, str], length: int) -> socket.socket:
    """A connection that has sent a POST's head announcing ``length`` bytes of body, and none of it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    lines = [f"POST {path} HTTP/1.1", "host: sidecar", f"content-length: {length}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return s


def answer(s: socket.socket, within: float) -> bytes:
    """The answer on ``s`` (its head, and its body as far as content-length says), or what came of
    it within ``within`` seconds (b"" if nothing): the head and the body may come in separate reads."""
    deadline = time.monotonic() + within
    got = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return got
        s.settimeout(left)
        try:
            part = s.recv(65536)
        except TimeoutError:
            return got
        except OSError:
            return got
        if not part:
            return got
        got += part
        head, sep, body = got.partition(b"\r\n\r\n")
        if sep:
            m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if m is None or len(body) >= int(m.group(1)):
                return got


def rss(sc) -> int:  # noqa: ANN001
    return psutil.Process(sc.child.proc.pid).memory_info().rss


def test_without_a_token_set_the_sidecar_makes_one_and_our_clients_find_it(sidecar):
    path = run_dir(sidecar) / "api-token"
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    r = httpx.post(f"{sidecar.url}/v1/jobs", json={"samples": [{"prompt": "my secret prompt"}]}, headers=auth(sidecar))
    assert r.status_code == 200, r.text
    job = r.json()["job_id"]
    # another local user (no token) reads no prompts, on loopback too
    assert httpx.get(f"{sidecar.url}/v1/jobs/{job}/samples").status_code == 401
    assert httpx.get(f"{sidecar.url}/v1/jobs/{job}/samples", headers=auth(sidecar)).status_code == 200
    assert httpx.get(f"{sidecar.url}/healthz").status_code == 200  # the probes stay open
    # the CLI finds the token in the run dir by itself (no HSSTREAM_API_TOKEN anywhere)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSSTREAM_")}
    env.update({"PYTHONPATH": str(ROOT), "HSSTREAM_RUN_DIR": str(run_dir(sidecar))})
    p = subprocess.run([sys.executable, "-m", "hsstream", "status", job, "--url", sidecar.url], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert p.returncode == 0 and job in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize(("route", "ctype"), [("/v1/jobs/upload", "multipart/form-data; boundary=b"),
                                               ("/v1/jobs", "application/json")])  # fmt: skip
def test_a_strangers_body_is_refused_from_its_head_and_drained(sidecar, route, ctype):
    before = rss(sidecar)
    s = head(sidecar.port, route, {"content-type": ctype}, 8 << 20)  # within the body limits
    try:
        s.sendall(b"x" * (64 << 10))
        got = answer(s, 3.0)
        assert got.startswith(b"HTTP/1.1 401"), got[:200]  # answered with 8 MiB announced and 64 KiB sent
        assert b"connection: close" in got.lower()
        for _ in range(127):  # the rest it goes on sending is drained, not reset
            s.sendall(b"y" * (64 << 10))
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        while s.recv(65536):  # ends with the sidecar's close, cleanly
            pass
    finally:
        s.close()
    assert rss(sidecar) - before < 32 << 20  # nothing of it held


def test_an_over_limit_body_is_a_413_the_client_reads(sidecar):
    """A client that sends its whole body before it reads (as Python's http.client, requests and
    most scripts do) reads the 413: the rest of its body is drained, not met with a reset."""
    body = b'{"samples": [{"prompt": "' + b"a" * (17 << 20) + b'"}]}'
    s = head(sidecar.port, "/v1/jobs", {**auth(sidecar), "content-type": "application/json"}, len(body))
    try:
        s.sendall(body)  # once: ConnectionResetError / BrokenPipeError here
        got = answer(s, 10.0)
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 413") and b"HSSTREAM_MAX_JSON_BYTES" in got, got[:300]

    def chunked():  # no content-length: counted as it arrives
        for _ in range(18):
            yield b"x" * (1 << 20)

    r = httpx.post(f"{sidecar.url}/v1/jobs", content=chunked(), timeout=60,
                   headers={**auth(sidecar), "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413, r.text[:300]


def test_a_stalled_body_gets_a_408_and_one_client_has_at_most_two_bodies(sidecar):
    h = {**auth(sidecar), "content-type": "multipart/form-data; boundary=b"}
    stalled = [head(sidecar.port, "/v1/jobs/upload", h, 1000) for _ in range(2)]
    try:
        for s in stalled:
            s.sendall(b"--b\r\n")  # a little of the body, then nothing
        time.sleep(0.3)
        third = head(sidecar.port, "/v1/jobs/upload", h, 1000)
        try:
            got = answer(third, 0.5)
            assert got.startswith(b"HTTP/1.1 429") and b"HSSTREAM_MAX_UPLOADS_PER_CLIENT" in got, got[:300]
        finally:
            third.close()
        for s in stalled:  # HSSTREAM_HTTP_BODY_TIMEOUT_S=1
            got = answer(s, 5.0)
            assert got.startswith(b"HTTP/1.1 408") and b"HSSTREAM_HTTP_BODY_TIMEOUT_S" in got, got[:300]
    finally:
        for s in stalled:
            s.close()
    # their places are free again
    r = httpx.post(f"{sidecar.url}/v1/jobs/upload", headers=auth(sidecar), timeout=60,
                   files={"file": ("a.jsonl", b'{"prompt": "hello"}\n')})  # fmt: skip
    assert r.status_code == 200, r.text


def test_text_that_cannot_fit_the_token_limit_is_refused_before_tokenising(sidecar):
    before = rss(sidecar)
    prompt = "the quick brown fox " * 100_000  # 2 MB; the tiny model takes 2,048 tokens
    t0 = time.monotonic()
    r = httpx.post(f"{sidecar.url}/v1/jobs", json={"samples": [{"id": "big", "prompt": prompt}]},
                   headers=auth(sidecar), timeout=120)  # fmt: skip
    assert r.status_code == 422, r.text[:300]
    reason = r.json()["detail"]["samples"][0]["reason"]
    assert "2,000,000 characters of text" in reason and "refused before tokenising" in reason, reason
    r = httpx.post(f"{sidecar.url}/v1/jobs/upload", headers=auth(sidecar), timeout=120,
                   files={"file": ("big.jsonl", ('{"prompt": "%s"}\n' % prompt).encode())})  # fmt: skip
    assert r.status_code == 422 and "longer than" in r.json()["detail"]["lines"][0]["reason"], r.text[:300]
    assert time.monotonic() - t0 < 20  # tokenising it took the sidecar 17 s and +370 MB here
    assert rss(sidecar) - before < 100 << 20


def _second(env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess:
    """Another `hsstream serve` with ``env``; one that comes up is stopped after ``timeout``."""
    p = subprocess.Popen([sys.executable, "-m", "hsstream", "serve"], env=env, cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        out, err = p.communicate(timeout=60)
        err += "\n(still running after the timeout: stopped)"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_a_second_sidecar_stops_before_touching_the_first(sidecar):
    rd = run_dir(sidecar)
    sockets = {n: os.stat(rd / n).st_ino for n in ("notice.sock", "delivery.sock")}
    pid = str(sidecar.child.proc.pid)
    # the same spool, its own run dir, ledger and port: it would recover, sweep and bind beside the first
    other = Path(tempfile.mkdtemp(prefix="hsstream-second-"))
    try:
        env = {**sidecar.env, "HSSTREAM_RUN_DIR": str(other), "HSSTREAM_PORT": str(free_port())}
        p = _second(env)
        assert p.returncode == 2 and "another sidecar is running on this spool" in p.stderr, p.stderr[-2000:]
        assert f"pid {pid}" in p.stderr and sidecar.url in p.stderr, p.stderr[-2000:]
        assert sorted(os.listdir(other)) == []  # no ledger, no socket, no token made
    finally:
        os.rmdir(other)
    # the same settings, its port taken: refused before anything (it once recovered the first's
    # ledger, rebound its sockets and removed them as it exited)
    p = _second(dict(sidecar.env))
    assert p.returncode == 2 and "Address already in use" in p.stderr and f"pid {pid}" in p.stderr, p.stderr[-2000:]
    assert {n: os.stat(rd / n).st_ino for n in sockets} == sockets
    # the first one's trainers still reach it
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"ipc://{rd}/delivery.sock")
    try:
        d.send_multipart(P.encode_msg(P.Hello(jobs=["none"])))
        assert d.poll(5000), "the first sidecar's delivery socket does not answer"
        assert isinstance(P.decode_msg(d.recv_multipart()), (P.Heartbeat, P.End))
    finally:
        d.close()
    assert sidecar.child.alive()
