"""``hsstream up`` as a user runs it: one command, a real process tree, driven by REST and signals.

The stack is real (vLLM CPU build, uvicorn sidecar, ZeroMQ) and so is the trainer: a separate
process started by ``up --trainer-cmd`` that follows every job with ``HiddenStateStream`` and
logs each sample it used (this file, run as a script). One ``up`` serves the first four tests
in order: a job flows; vLLM is SIGKILLed mid-job and comes back with nothing lost; so is the
sidecar; SIGINT stops everything. A second ``up`` with ``--max-restarts 0`` must give up clearly, not hang.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from connector import protocol as P
from hsstream.devstack import free_port
from hsstream.up import VLLM_STOP_NOISE, group_shm_files
from tests.conftest import CPU_BUILD_EXECUTOR

ROOT = Path(__file__).resolve().parents[3]
LAYERS = "2,6,9,12"
START_TIMEOUT = 900  # one engine start is ~40 s alone on 2 cores, minutes when others run tests


class Up:
    """A running ``hsstream up`` and what it printed."""

    def __init__(self, tmp: Path, model: str, *args: str, command: list[str] | None = None, cwd: Path = ROOT,
                 env_changes: dict[str, str | None] | None = None) -> None:  # fmt: skip
        """``command``: the whole command line (default ``python -m hsstream up --max-model-len
        1024 ARGS``), run in ``cwd``; the stack's ports and folders come from the environment,
        ``env_changes`` changing it (None: unset)."""
        self.tmp = tmp
        self.spool = Path("/dev/shm") / f"hsstream-up-test-{uuid.uuid4().hex[:8]}"  # up creates and removes it
        self.run_dir = tmp / "run"
        self.api_port, self.vllm_port = free_port(), free_port()
        self.used_log = tmp / "used.jsonl"
        self.out_path = tmp / "up.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HSSTREAM_")}
        env.update({
            "HSSTREAM_MODEL": model, "HSSTREAM_LAYER_IDS": LAYERS,
            "HSSTREAM_SPOOL_DIR": str(self.spool), "HSSTREAM_RUN_DIR": str(self.run_dir),
            "HSSTREAM_PORT": str(self.api_port), "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{self.vllm_port}",
            # a sample whose notice died with vLLM is retried after this long
            "HSSTREAM_NOTICE_TIMEOUT_S": "20",
            **CPU_BUILD_EXECUTOR,  # `hsstream up` as users run it on this build: worker and engine core apart
        })  # fmt: skip
        env["PYTHONPATH"] = str(ROOT)  # this checkout's code, whichever `hsstream` runs it
        for k, v in (env_changes or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.env = env
        self._out = open(self.out_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            command or [sys.executable, "-m", "hsstream", "up", "--max-model-len", "1024", *args],
            env=env, cwd=cwd, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.seen: dict[int, psutil.Process] = {}

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def headers(self) -> dict[str, str]:
        """The bearer header with the token the stack's sidecar made in its run dir."""
        from connector.contract.api_token import read_token
        from connector.contract.rest_client import auth_headers

        return auth_headers(read_token(self.run_dir))

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def up_lines(self) -> list[str]:
        return [ln for ln in self.output().splitlines() if ln.startswith("up ")]

    def wait_for(self, text: str, timeout: float, since: int = 0) -> None:
        t0 = time.monotonic()
        while text not in "\n".join(self.up_lines()[since:]):
            if self.proc.poll() is not None:
                pytest.fail(f"`hsstream up` exited ({self.proc.returncode}) before {text!r}:\n{self.tail()}")
            if time.monotonic() - t0 > timeout:
                pytest.fail(f"no {text!r} from `hsstream up` after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def note_processes(self) -> dict[int, psutil.Process]:
        """Remember every descendant now, to check later that none outlived ``up``."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            self.seen[p.pid] = p
        return self.seen

    def vllm_process(self) -> psutil.Process:
        for p in psutil.Process(self.proc.pid).children():
            if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()):
                return p
        pytest.fail(f"no vLLM child of `hsstream up` ({self.proc.pid}):\n{self.tail()}")

    def survivors(self) -> list[str]:
        out = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        return out

    def kill(self) -> None:
        """Cleanup for a test that failed half-way: stop ``up``, then anything it left, and the spool."""
        import shutil

        if self.proc.poll() is None:
            self.note_processes()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for p in self.seen.values():
            try:
                p.kill()  # psutil checks the start time: never a recycled pid
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.spool, ignore_errors=True)
        self._out.close()


def submit(up: Up, n: int, seed: int, length: tuple[int, int] = (16, 120)) -> tuple[str, int]:
    rng = random.Random(seed)
    samples = [
        {"token_ids": [rng.randrange(0, 509) for _ in range(rng.randint(*length))], "id": f"s{i}"} for i in range(n)
    ]
    r = httpx.post(f"{up.api}/v1/jobs", json={"samples": samples}, timeout=60, headers=up.headers)
    assert r.status_code == 200, r.text
    return r.json()["job_id"], n


def counts(up: Up, job: str) -> dict:
    return httpx.get(f"{up.api}/v1/jobs/{job}", timeout=10, headers=up.headers).json()["counts"]


def wait_done(up: Up, job: str, timeout: float) -> dict:
    t0 = time.monotonic()
    while True:
        c = counts(up, job)
        if c["queued"] + c["submitted"] + c["ready"] + c["leased"] == 0:
            return c
        if up.proc.poll() is not None:
            pytest.fail(f"`hsstream up` exited ({up.proc.returncode}) with job {job} at {c}:\n{up.tail()}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"job {job} not done after {timeout:.0f} s: {c}\n{up.tail()}")
        time.sleep(0.5)


def used(up: Up, job: str) -> list[str]:
    if not up.used_log.exists():
        return []
    return [r["key"] for r in map(json.loads, up.used_log.read_text().splitlines()) if r["job"] == job]


def spool_files(up: Up) -> list[str]:
    """Everything in the spool but the ownership marker and the running sidecar's lock."""
    keep = (P.SPOOL_MARKER, P.SIDECAR_LOCK)
    return sorted(n for n in os.listdir(up.spool) if n not in keep) if up.spool.exists() else []


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    trainer = f"{sys.executable} -m tests.integration.hsstream.test_up --log {tmp / 'used.jsonl'}"
    up = Up(tmp, tiny_model, "--max-restarts", "3", "--trainer-cmd", trainer)
    try:
        up.wait_for("stack ready", START_TIMEOUT)
        yield up
    finally:
        up.kill()


# ----------------------------------------------------------------------------- one `up`, in order


def test_up_starts_the_stack_and_the_trainer_consumes_a_job(stack):
    lines = "\n".join(stack.up_lines())
    for name in ("sidecar", "vllm", "trainer"):
        assert f"started {name} (pid" in lines
    assert "vllm ready after" in lines
    # the children's logs are streamed, each line prefixed with its process
    vllm_lines = [ln for ln in stack.output().splitlines() if ln.startswith("vllm    | ")]
    assert any("APIServer" in ln or "api_server" in ln for ln in vllm_lines)
    stack.note_processes()
    job, n = submit(stack, 24, seed=1)
    c = wait_done(stack, job, 300)
    assert c["consumed"] == n and c["failed"] == 0, c
    keys = used(stack, job)
    assert len(keys) == n and len(set(keys)) == n  # each sample used once, by the trainer process
    time.sleep(0.5)
    assert spool_files(stack) == []


def test_vllm_killed_mid_job_is_restarted_and_the_job_completes(stack):
    mark = len(stack.up_lines())
    # Everything slow is looked up before the job starts, so the kill follows the first sign of
    # progress at once (on a fast CI host the whole job once finished in the gap).
    vllm = stack.vllm_process()
    stack.note_processes()
    shm = group_shm_files(vllm.pid)  # vLLM's queues between its processes, ~400 MB here
    assert shm, "found no shared memory of vLLM's to watch"
    job, n = submit(stack, 400, seed=2, length=(100, 400))
    t0 = time.monotonic()
    while True:  # the job is under way: vLLM has made a few samples, most not
        c = counts(stack, job)
        if c["ready"] + c["leased"] + c["consumed"] >= 3:
            break
        assert time.monotonic() - t0 < 300, f"job {job} does not progress: {c}"
        time.sleep(0.05)
    vllm.send_signal(signal.SIGKILL)
    at_kill = counts(stack, job)
    # what matters: vLLM died with work of its own unfinished (those requests are sent again)
    assert at_kill["queued"] + at_kill["submitted"] > 0, f"vLLM finished the job before it was killed ({at_kill})"
    stack.wait_for("vllm died (killed by SIGKILL): restarting it (1/3)", 30, since=mark)
    stack.wait_for("vllm is back after", START_TIMEOUT, since=mark)
    assert not [f for f in shm if os.path.exists(f)], "the killed vLLM's shared memory stayed in /dev/shm"
    assert stack.vllm_process().pid != vllm.pid
    stack.note_processes()
    c = wait_done(stack, job, 600)
    assert c["consumed"] == n and c["failed"] == 0, f"lost samples after the restart: {c} (at kill: {at_kill})"
    keys = used(stack, job)
    assert sorted(set(keys)) == sorted(keys) and len(keys) == n, "a sample was used twice or not at all"
    time.sleep(0.5)
    assert spool_files(stack) == []


def test_sidecar_killed_mid_job_is_restarted_and_the_trainer_reconnects(stack):
    """The sidecar SIGKILLed under load: `up` restarts it (as compose's restart policy would),
    the new one recovers the ledger and reaps the spool, the trainer process reconnects on its
    own, and every sample is used exactly once with nothing left in the spool."""
    mark = len(stack.up_lines())
    (sidecar,) = [p for p in psutil.Process(stack.proc.pid).children() if "-m hsstream serve" in " ".join(p.cmdline())]
    job, n = submit(stack, 150, seed=3, length=(50, 200))
    t0 = time.monotonic()
    while True:  # under way: a few samples made, most not (the kill follows at once)
        at_kill = counts(stack, job)
        if at_kill["ready"] + at_kill["leased"] + at_kill["consumed"] >= 3:
            break
        assert time.monotonic() - t0 < 300, f"job {job} does not progress: {at_kill}"
        time.sleep(0.05)
    sidecar.send_signal(signal.SIGKILL)
    assert at_kill["consumed"] < n, f"the job finished before the sidecar was killed: make it longer ({at_kill})"
    stack.wait_for("sidecar died (killed by SIGKILL): restarting it (1/3)", 30, since=mark)
    stack.wait_for("sidecar is back after", 120, since=mark)
    c = wait_done(stack, job, 600)
    assert c["consumed"] == n and c["failed"] == 0, f"lost samples after the restart: {c} (at kill: {at_kill})"
    keys = used(stack, job)
    assert sorted(set(keys)) == sorted(keys) and len(keys) == n, "a sample was used twice or not at all"
    assert "stopping the stack" not in "\n".join(stack.up_lines()[mark:])
    time.sleep(0.5)
    assert spool_files(stack) == []


def test_ctrl_c_stops_every_process_cleanly_and_empties_the_spool(stack):
    """Ctrl-C (SIGINT; SIGTERM takes the same path, see test_readme) reads as a clean stop:
    every child exits 0, the supervisor says "stopped cleanly", and nothing it prints from the
    signal on is a warning (vLLM's "leaked shared_memory" ones were, before the ordered stop)."""
    t0 = time.monotonic()  # the trainer is up and streaming (run alone, this test comes right after start)
    while not httpx.get(f"{stack.api}/v1/overview", timeout=10, headers=stack.headers).json()["trainers"]:
        assert time.monotonic() - t0 < 120, f"the trainer never connected:\n{stack.tail()}"
        time.sleep(0.5)
    stack.note_processes()
    assert len(stack.seen) >= 4  # sidecar, vLLM (+ engine, worker), trainer
    mark = len(stack.output().splitlines())
    stack.proc.send_signal(signal.SIGINT)
    try:
        rc = stack.proc.wait(180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`hsstream up` still running 180 s after SIGINT:\n{stack.tail()}")
    assert rc == 0, stack.tail()
    assert_stopped_cleanly(stack.output().splitlines()[mark:], "SIGINT")
    assert stack.survivors() == []
    assert not stack.spool.exists(), f"spool left: {spool_files(stack)}"


#: What must not appear in the output of a clean stop.
NOT_CLEAN = ("warn", "leaked", "traceback", "error", "killed by")


def assert_stopped_cleanly(
    lines: list[str], signame: str, children: tuple[str, ...] = ("trainer", "vllm", "sidecar")
) -> None:
    """The output of ``hsstream up`` from the stop signal on reads as a clean stop."""
    text = "\n".join(lines)
    up = [ln for ln in lines if ln.startswith("up ")]
    assert f"{signame} received: stopping the stack" in "\n".join(up), text
    for name in children:
        assert any(f"stopped {name} (exit code 0)" in ln for ln in up), f"{name} did not exit 0:\n{text}"
    assert any("stopped cleanly (every child exited 0)" in ln for ln in up), text
    # vLLM's known stop noise, each told in its one explaining line (once per engine) while we stop
    # it, is the "explained in one line" a clean stop may hold (the wording has none of NOT_CLEAN's
    # words); the raw lines and anything else are not
    told = [(ln.split("|", 1)[0], why) for ln in lines for _, why in VLLM_STOP_NOISE if ln.endswith(why)]
    assert len(told) == len(set(told)), "vLLM's stop noise told twice for one engine:\n" + text
    bad = [ln for ln in lines if any(w in ln.lower() for w in NOT_CLEAN)]
    assert bad == [], "warnings in a clean stop:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- no restart left


def test_with_max_restarts_0_a_dead_vllm_stops_the_stack_with_a_clear_error(tiny_model, tmp_path):
    up = Up(tmp_path, tiny_model, "--max-restarts", "0")
    try:
        up.wait_for("stack ready", START_TIMEOUT)
        up.note_processes()
        up.vllm_process().send_signal(signal.SIGKILL)
        try:
            rc = up.proc.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`hsstream up --max-restarts 0` hangs after vLLM died:\n{up.tail()}")
        assert rc == 1, up.tail()
        lines = "\n".join(up.up_lines())
        assert "vllm died (killed by SIGKILL) and no restart is left (--max-restarts 0" in lines, up.tail()
        assert "restarting it" not in lines
        assert up.survivors() == []
        assert not up.spool.exists()
    finally:
        up.kill()


# ----------------------------------------------------------------------------- the trainer process


def _trainer_main(argv: list[str]) -> int:
    """A trainer for these tests: follows every job, logs each sample it used; stops on SIGTERM.

    Endpoint and spool come from the HSSTREAM_* settings ``up`` passes on, as a real trainer's do.
    """
    import argparse

    from hsstream.launch import exit_0_on_stop

    exit_0_on_stop()  # as `hsstream train` does (first thing): a stop asked for is a clean exit
    from trainer_client import HiddenStateStream

    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    a = ap.parse_args(argv)
    with open(a.log, "a", buffering=1) as out, HiddenStateStream(follow=True, timeout_s=3600) as stream:
        for s in stream:
            out.write(json.dumps({"key": str(s.key), "job": s.key.job, "tokens": int(s.token_ids.shape[0])}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_trainer_main(sys.argv[1:]))
