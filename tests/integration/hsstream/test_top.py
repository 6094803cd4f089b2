"""``hsstream top`` as a user sees it: a real terminal (a pseudo-terminal rendered by pyte, a
VT100 emulator), a real sidecar with vLLM behind it, and a real trainer (``HiddenStateStream``
in this process). Every figure read off the screen is checked against the REST API, read
before and after the screen (a figure that moves may lie between the two, never outside).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pexpect
import pyte
import pytest

from hsstream.devstack import free_port
from tests.conftest import SESSION_ENV
from tests.integration.conftest import stack_fixture, start_stack, stop_stack, submit, tiny
from trainer_client import HiddenStateStream

ROOT = Path(__file__).resolve().parents[3]
COLS, ROWS = 200, 60
NUM = r"([\d,.]+)"


class Terminal:
    """A command in a pseudo-terminal of COLS x ROWS, and the screen it has drawn so far."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        env.update({"PYTHONPATH": str(ROOT), "TERM": "xterm-256color", **extra})
        self.screen = pyte.Screen(COLS, ROWS)
        self.stream = pyte.ByteStream(self.screen)
        self.child = pexpect.spawn(sys.executable, ["-m", "hsstream", *args], env=env, cwd=str(ROOT),
                                   dimensions=(ROWS, COLS))  # fmt: skip

    def pump(self, seconds: float) -> str:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.stream.feed(self.child.read_nonblocking(65536, timeout=0.1))
            except pexpect.TIMEOUT:
                continue
            except pexpect.EOF:
                break
        return self.text()

    def text(self) -> str:
        return "\n".join(line.rstrip() for line in self.screen.display).strip("\n")

    def close(self) -> None:
        if self.child.isalive():
            self.child.kill(signal.SIGKILL)
        self.child.close()


def overview(stack) -> dict:  # noqa: ANN001 - a devstack Stack
    r = httpx.get(f"{stack.api}/v1/overview", timeout=30, headers=stack.headers)
    assert r.status_code == 200, r.text
    return r.json()


def num(s: str) -> float:
    return float(s.replace(",", ""))


def between(shown: float, a: float, b: float, what: str, screen: str) -> None:
    assert min(a, b) <= shown <= max(a, b), f"{what}: screen shows {shown}, API said {a} then {b}\n{screen}"


def pct(x: float | None) -> float | None:
    return None if x is None else round(100 * x, 1)


#: Figures that only move one way once the trainer has stopped: between before and after
#: means right. The others (ready, leased, ... while vLLM still produces) are checked once
#: production has settled too.
MONOTONE = {"consumed", "failed", "cancelled"}


def check_frame(screen: str, before: dict, after: dict, settled: bool) -> dict:
    """The figures on the screen lie between the API's before and after. Returns some."""
    got: dict = {}
    m = re.search(rf"^jobs {NUM}  done {NUM}  running {NUM}$", screen, re.M)
    assert m, screen
    got["jobs"] = [num(x) for x in m.groups()]
    for i, key in enumerate(("jobs_total", "jobs_done")):
        between(got["jobs"][i], before[key], after[key], key, screen)
    m = re.search(r"^samples  (.*)$", screen, re.M)
    assert m, screen
    pairs = dict(re.findall(r"(\w+) ([\d,]+)", m.group(1)))
    assert {"queued", "submitted", "ready", "leased", "consumed", "failed"} <= set(pairs), screen
    for state, v in pairs.items():
        if settled or state in MONOTONE:
            between(num(v), before["samples"][state], after["samples"][state], f"samples {state}", screen)
    m = re.search(rf"^rate  {NUM} samples/s  {NUM} tokens/s  \(consumed, last 10 s\)$", screen, re.M)
    assert m, screen
    got["rate"] = [num(x) for x in m.groups()]
    between(got["rate"][0], before["rates"]["samples_per_s"], after["rates"]["samples_per_s"], "samples/s", screen)
    between(got["rate"][1], before["rates"]["tokens_per_s"], after["rates"]["tokens_per_s"], "tokens/s", screen)
    m = re.search(rf"^spool  {NUM} of {NUM} B \({NUM} %\)  reserved {NUM} B  ready {NUM}$", screen, re.M)
    assert m, screen
    files, budget, _fill, reserved, ready = (num(x) for x in m.groups())
    assert budget == before["spool"]["budget_bytes"] == after["spool"]["budget_bytes"], screen
    got["files"] = files
    if not settled:
        return got
    between(files, before["spool"]["file_bytes"], after["spool"]["file_bytes"], "spool bytes", screen)
    between(reserved, before["spool"]["reserved_bytes"], after["spool"]["reserved_bytes"], "reserved", screen)
    between(ready, before["ready"], after["ready"], "ready", screen)
    # the jobs table: one row per job, its counts under the header's state columns
    header = next(ln for ln in screen.splitlines() if ln.startswith("job ") and "consumed" in ln)
    cols = header.split()
    by_id = lambda jobs: sorted(jobs, key=lambda j: j["job_id"])  # noqa: E731
    for b, a in zip(by_id(before["jobs"]), by_id(after["jobs"]), strict=True):
        row = next((ln.split() for ln in screen.splitlines() if ln.startswith(b["job_id"] + " ")), None)
        assert row, f"no row for job {b['job_id']}\n{screen}"
        cells = dict(zip(cols, row))
        assert cells["state"] in (("done" if b["done"] else "running"), ("done" if a["done"] else "running"))
        assert num(cells["of"]) == b["num_samples"]
        for state in cols[2:-1]:
            between(num(cells[state]), b["counts"][state], a["counts"][state], f"job {b['job_id']} {state}", screen)
    # the trainers table
    for t_b in before["trainers"]:
        t_a = next(t for t in after["trainers"] if t["id"] == t_b["id"])
        row = next((ln.split() for ln in screen.splitlines() if ln.startswith(t_b["id"] + " ")), None)
        assert row, f"no row for trainer {t_b['id']}\n{screen}"
        # trainer credit delivered acked "wait now" "wait all" seen jobs
        _id, credit, delivered, acked = row[:4]
        assert row[-1] == ("all" if t_b["jobs"] is None else " ".join(t_b["jobs"])), screen
        for what, shown in (("credit", credit), ("delivered", delivered), ("acked", acked)):
            between(num(shown), t_b[what], t_a[what], f"trainer {what}", screen)
        shares = re.findall(r"(–|[\d.]+ %)", " ".join(row[4:]))
        for shown, key in zip(shares[:2], ("wait_share_recent", "wait_share")):
            lo, hi = pct(t_b[key]), pct(t_a[key])
            if shown == "–":
                assert lo is None or hi is None, f"{key}: API has a figure, screen none\n{screen}"
            else:
                assert lo is not None and hi is not None, screen
                between(num(shown.split()[0]), lo, hi, f"trainer {key}", screen)
        got.setdefault("shares", []).append(shares[:2])
    return got


def clock_s(screen: str) -> int | None:
    """The first line's clock (when the frame was drawn, after its fetch), seconds of the day."""
    m = re.search(r"(\d\d):(\d\d):(\d\d)  every 1 s", screen.splitlines()[0] if screen else "")
    return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])


def pump_until(term: Terminal, done, at_least: float, at_most: float = 20.0) -> str:  # noqa: ANN001
    """The screen after ``at_least`` seconds and once ``done(screen)``: a loaded machine draws
    later than the view's 1 s refresh promises, so the test waits for the frame, not a time."""
    screen, t0 = term.pump(at_least), time.monotonic()
    while not done(screen) and time.monotonic() - t0 < at_most:
        screen = term.pump(0.25)
    return screen


def read_checked(term: Terminal, stack, settled: bool) -> tuple[str, dict]:  # noqa: ANN001
    before = overview(stack)
    lt = time.localtime()
    since = lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec
    # A frame drawn 2 clock seconds after `before` was read fetched after it (unless its fetch
    # took over a second); at least two refreshes' time in any case.
    screen = pump_until(term, lambda sc: (c := clock_s(sc)) is not None and 2 <= (c - since) % 86400 < 3600, 2.5)
    after = overview(stack)
    return screen, check_frame(screen, before, after, settled)


def _start():
    # a trainer that stops iterating stays connected (its leases held) for the whole test
    return start_stack(tiny(), [2, 6, 9, 12], env={"HSSTREAM_TRAINER_TIMEOUT_S": "900", "HSSTREAM_MAX_READY_SAMPLES": "16"},
                       base_env=SESSION_ENV)  # fmt: skip


PRESTART = {"stack": (_start, stop_stack)}  # tests/support/prestart.py
stack = stack_fixture(__name__)


def samples(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"token_ids": [rng.randrange(0, 509) for _ in range(rng.randint(20, 90))]} for _ in range(n)]


def test_top_shows_what_the_api_says_while_a_trainer_streams(stack):
    term = Terminal("top", "--url", stack.api, env={"HSSTREAM_RUN_DIR": str(stack.run_dir)})  # its token, found there
    job = stream = it = None
    try:
        first = pump_until(term, lambda sc: "no jobs yet" in sc and "no trainer connected" in sc, 1)
        assert "no jobs yet" in first and "no trainer connected" in first, first
        # a finished job, consumed by a trainer that then went away
        done_job = submit(stack, samples(6, 1))
        with HiddenStateStream(stack.delivery_endpoint, jobs=[done_job], spool_dir=stack.spool, timeout_s=300) as s:
            assert len(list(s)) == 6
        # a running job, and a trainer that computes between samples, then stops iterating
        job = submit(stack, samples(60, 2))
        stream = HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, credit=4,
                                   timeout_s=300, heartbeat_s=0.5)  # fmt: skip
        it = iter(stream)
        for _ in range(14):
            next(it)
            time.sleep(0.15)  # the training step
        # consumption just stopped: rates are not zero yet and only decay (from the next whole
        # second on: the current one is not counted yet); they must match the API
        time.sleep(1.1)
        live, got = read_checked(term, stack, settled=False)
        assert got["rate"][0] > 0 and got["rate"][1] > 0, live
        assert f"{job} running" in " ".join(live.split()), live
        # production stops at the ready limit or at the end of the job: then nothing moves
        t0, last = time.monotonic(), None
        while True:
            ov = overview(stack)
            now = (ov["samples"], ov["spool"], ov["ready"])
            if now == last and ov["samples"]["submitted"] == 0:
                break
            assert time.monotonic() - t0 < 300, f"production does not settle: {ov}"
            last = now
            time.sleep(2)
        stable, got = read_checked(term, stack, settled=True)
        ov = overview(stack)
        assert got["files"] > 0 and ov["ready"] > 0, stable  # figures worth checking, not zeros
        assert ov["samples"]["consumed"] >= 6 + 13 and ov["jobs_done"] == 1, ov
        (trainer,) = [t for t in ov["trainers"] if t["jobs"] == [job]]
        assert 0 < trainer["wait_share"] < 1 and trainer["wait_share_recent"] is not None, trainer
        assert trainer["acked"] >= 13, trainer
        # refreshed every second: the clock on the first line moves
        clock = re.search(r"(\d\d:\d\d:\d\d)  every 1 s", stable)
        later = pump_until(term, lambda sc: bool(clock) and clock.group(1) not in sc.splitlines()[0], 1.5, 10)
        assert clock and clock.group(1) not in later.splitlines()[0], later
        # Ctrl-C quits cleanly
        term.child.sendintr()
        try:
            term.child.expect(pexpect.EOF, timeout=10)
        except pexpect.TIMEOUT:  # say where it hangs: the Python stacks of the live view
            spy = str(Path(sys.executable).with_name("py-spy"))
            dump = subprocess.run([spy, "dump", "--pid", str(term.child.pid)], capture_output=True, text=True)
            pytest.fail(f"hsstream top did not exit on Ctrl-C within 10 s:\n{dump.stdout}{dump.stderr}\n{term.text()}")
        term.child.close()
        assert term.child.exitstatus == 0, term.text()
    finally:
        term.close()
        if it is not None:
            it.close()
        if stream is not None:
            stream.close()
        if job is not None:  # the trainer left with leases: cancelling the job frees the spool
            httpx.delete(f"{stack.api}/v1/jobs/{job}", timeout=30, headers=stack.headers)
        t0 = time.monotonic()
        while stack.spool_files() and time.monotonic() - t0 < 30:
            time.sleep(0.2)


def test_top_when_the_sidecar_is_not_there():
    url = f"http://127.0.0.1:{free_port()}"
    once = subprocess.run([sys.executable, "-m", "hsstream", "top", "--once", "--url", url], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    out, rc = once.stdout + once.stderr, once.returncode
    assert rc == 3 and f"sidecar not reachable at {url}" in out and "Connection refused" in out, out
    term = Terminal("top", "--url", url)
    try:
        screen = pump_until(term, lambda sc: "retrying every 1 s" in sc, 1)
        assert f"sidecar not reachable at {url}" in screen and "retrying every 1 s" in screen, screen
        assert term.child.isalive()  # a live view waits for the sidecar to come (back)
    finally:
        term.close()
