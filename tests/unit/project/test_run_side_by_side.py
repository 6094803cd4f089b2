"""`make test`'s runner (tests/run.py): the two suites side by side, the unit one in a /dev/shm of its own."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests import run

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("codes", "want"), [
    ((0, 0), 0), ((1, 0), 1), ((0, 1), 1), ((2, 1), 2), ((5, 0), 0), ((0, 5), 0), ((5, 5), 5), ((5, 1), 1),
])  # fmt: skip
def test_the_exit_status_is_the_worse_of_the_two(codes, want):
    assert run.combined_status(*codes) == want


def test_the_private_shm_hides_the_hosts_and_is_a_fresh_tmpfs():
    """What the unit suite's guards rely on: inside the prefix, /dev/shm is another, empty tmpfs
    (a file put in the host's is not there; a file made inside never reaches the host's)."""
    prefix = run.private_shm_prefix()
    if prefix is None:
        pytest.skip("this host cannot make a private /dev/shm (unshare --mount): make test runs the suites in turn")
    mine = Path("/dev/shm") / f"hsstream-runner-probe-{uuid.uuid4().hex}"
    mine.write_text("host")
    inside = f"/dev/shm/hsstream-runner-inside-{uuid.uuid4().hex}"
    try:
        p = subprocess.run([*prefix, "sh", "-c", f"ls -A /dev/shm; stat -f -c %T /dev/shm; touch {inside}"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert p.returncode == 0, p.stderr
        listing = p.stdout.split()
        assert mine.name not in listing and listing == ["tmpfs"], p.stdout
        assert not os.path.exists(inside)
    finally:
        mine.unlink()


def test_side_by_side_waits_for_both_prints_the_units_output_and_returns_the_worse_status():
    code = "import sys, time; time.sleep({t}); print({msg!r}); sys.exit({rc})"
    unit = [sys.executable, "-c", code.format(t=0.1, msg="unit says 3 passed", rc=1)]
    integration = [sys.executable, "-c", code.format(t=0.6, msg="integration ok", rc=0)]
    out = io.StringIO()
    assert run.run_side_by_side(unit, integration, out=out) == 1
    text = out.getvalue()
    assert "side lane ended after" in text and "exit 1: unit says 3 passed" in text
    # its whole output once both are done (the integration suite's own went to the terminal meanwhile)
    whole = text.split("---- the side lane's output (unit + integration without vLLM) ----", 1)[1]
    assert "unit says 3 passed" in whole
    assert "side lane exit 1, engines' lane exit 0" in text


def test_without_a_private_shm_the_suites_run_in_turn_as_pytest_tests(monkeypatch):
    calls = []
    monkeypatch.setattr(run, "private_shm_prefix", lambda: None)
    monkeypatch.setattr(run.subprocess, "call", lambda cmd, cwd: calls.append(cmd) or 0)
    assert run.main(["-x"]) == 0
    assert calls == [[sys.executable, "-m", "pytest", "tests", "-x"]]


def test_with_a_private_shm_the_side_lane_runs_inside_it_at_a_lower_priority(monkeypatch):
    seen = {}
    monkeypatch.setattr(run, "private_shm_prefix", lambda: ["PREFIX"])
    monkeypatch.setattr(run, "run_side_by_side", lambda side, engines: seen.update(u=side, i=engines) or 0)
    assert run.main(["-q"]) == 0
    side, engines = run.lanes()
    assert seen["u"] == ["PREFIX", "nice", "-n", str(run.SIDE_NICE), sys.executable, "-m", "pytest", *side, "-q"]
    assert seen["i"] == [sys.executable, "-m", "pytest", *engines, "-q"]


def test_every_test_module_is_in_exactly_one_lane_and_no_engine_starts_in_the_side_lane():
    from tests.support.vllm_starts import starts_vllm

    side, engines = run.lanes()
    assert side[0] == "tests/unit" and engines[0] == "tests/integration"
    quiet = set(side[1:])
    assert engines[1:] == [f"--ignore={q}" for q in sorted(quiet)]
    every = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    in_side = {m for m in every if m.startswith("tests/unit/")} | quiet
    in_engines = {m for m in every if m.startswith("tests/integration/")} - quiet
    assert in_side | in_engines == every and not in_side & in_engines
    assert not any(starts_vllm(ROOT / q) for q in quiet)
    # what the lanes are for: the sidecar-only modules beside, the engines' modules apart
    assert "tests/integration/server/test_sidecar_hardening.py" in quiet
    engines_modules = {"tests/integration/server/test_reliability.py", "tests/integration/hsstream/test_proxy_swap.py"}
    assert engines_modules <= in_engines


def test_make_test_runs_this_runner():
    make = (ROOT / "Makefile").read_text()
    body = make.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-m tests.run" in body, body
