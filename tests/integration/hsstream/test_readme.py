"""Every command in README.md, run as a reader would run it, against the stack README starts.

The fenced ``sh`` blocks are split into commands; each one is either run, or listed in
EXCLUDED with the reason it cannot run here (so a new command is run unless someone says why
not). README's own ``.venv/bin/hsstream up`` is the stack: started first, stopped with SIGTERM
last (and that stop must read as clean). The ``python`` block is saved as ``loop.py``, as
README says. The others run in order in one shell (``set -e``: later commands use ``$JOB``),
in a scratch folder with the clone's ``.venv`` and a copy of ``deploy/``; a command that fails
fails the test with its output. Where README shows a command's output (``# {...}``), the
output must have the same fields, and the same values but for ids.

Only the port and the stack's folders differ from what a reader gets: ``localhost:8100``
(the default ``HSSTREAM_PORT``) becomes a free port, and the ``HSSTREAM_*`` variables point
all commands at this test's stack.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.hsstream.test_up import START_TIMEOUT, Up, assert_stopped_cleanly

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DEFAULT_API = "localhost:8100"
STACK = ".venv/bin/hsstream up"

#: Commands not run here, by a pattern that matches them, and why.
EXCLUDED = {
    r"^make demo\b": "`make` (re)installs .venv; make demo runs in CI, its result is bench/results/acceptance_cpu.json",
    r"^make test\b": "`make` (re)installs .venv, and runs this very test",
    r"^\.venv/bin/hsstream up --env-file deploy/\.env": "needs deploy/.env edited for a GPU host's model and GPUs",
    r"^docker compose ": "Docker and (but for --profile cpu) GPUs; compose's file is checked by test_deploy_compose.py",
    r"^HSSTREAM_MODEL=/models/Qwen3-8B ": "a GPU host's model; `hsstream vllm` and `serve` run inside `hsstream up`",
    r"^hsstream submit data\.jsonl .*--follow": "the GPU stack of its block; `hsstream submit` runs above",
    r"^\.venv/bin/hsstream top\s*(#.*)?$": "interactive until Ctrl-C; test_top.py drives it in a pseudo-terminal",
}


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def commands(body: str) -> list[tuple[str, str | None]]:
    """(command, the output README shows for it or None). A command spans lines while a quote
    is open or a line ends in a backslash; comment lines are not commands."""
    out: list[tuple[str, str | None]] = []
    cur: list[str] = []
    for line in body.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            if out and line.startswith("# {") and out[-1][1] is None:
                out[-1] = (out[-1][0], line[2:])
            continue
        cur.append(line)
        joined = "\n".join(cur)
        try:
            shlex.split(joined, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if joined.endswith("\\"):
            continue
        out.append((joined, None))
        cur = []
    assert not cur, f"unterminated command in README: {cur}"
    return out


def excluded(cmd: str) -> str | None:
    hits = [why for pat, why in EXCLUDED.items() if re.search(pat, cmd)]
    assert len(hits) <= 1, f"{cmd!r} matches several exclusions"
    return hits[0] if hits else None


def readme_plan() -> tuple[list[tuple[str, str | None]], str, list[str]]:
    """(commands to run in order, the python block, the commands excluded)."""
    run, skipped, pys, seen = [], [], [], set()
    for lang, body in blocks(README.read_text()):
        if lang == "python":
            pys.append(body)
        elif lang in ("sh", "bash", "shell"):
            for cmd, shown in commands(body):
                why = excluded(cmd)
                seen.update(p for p in EXCLUDED if re.search(p, cmd))
                if why:
                    skipped.append(cmd)
                elif cmd.split("#")[0].strip() != STACK:
                    run.append((cmd, shown))
    stale = set(EXCLUDED) - seen
    assert not stale, f"exclusions that match no README command any more: {stale}"
    assert len(pys) == 1, "README has one python block (loop.py)"
    return run, pys[0], skipped


def test_readme_plan_runs_every_command_but_the_listed_ones():
    run, _py, _skipped = readme_plan()
    text = README.read_text()
    assert STACK in text and "make demo" in text and "make test" in text
    assert any(c.startswith("curl ") and '"samples"' in c and '"options"' in c for c, _ in run)
    assert any("loop.py" in c for c, _ in run) and any("/metrics" in c for c, _ in run)
    assert "localhost:8100/docs" in text


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    """README's `.venv/bin/hsstream up`, verbatim, in a scratch folder."""
    tmp = tmp_path_factory.mktemp("readme")
    work = tmp / "clone"
    work.mkdir()
    (work / ".venv").symlink_to(ROOT / ".venv")
    shutil.copytree(ROOT / "deploy", work / "deploy")
    up = Up(tmp, tiny_model, command=[str(work / shlex.split(STACK)[0]), *shlex.split(STACK)[1:]], cwd=work)
    try:
        up.wait_for("stack ready", START_TIMEOUT)
        yield up, work
    finally:
        up.kill()


def test_every_readme_command_runs_against_the_stack(stack):
    up, work = stack
    run, py, _ = readme_plan()
    (work / "loop.py").write_text(py)
    port = str(up.api_port)
    env = {**up.env, "PYTHONUNBUFFERED": "1"}
    script = ["set -euo pipefail"]
    for i, (cmd, _shown) in enumerate(run):
        script += [f"echo '@@ {i}'", cmd.replace(DEFAULT_API, f"localhost:{port}"), "echo"]
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    parts = re.split(r"^@@ (\d+)\n", r.stdout, flags=re.M)[1:]
    outputs = {int(parts[i]): parts[i + 1] for i in range(0, len(parts), 2)}
    if r.returncode != 0:
        last = max(outputs) if outputs else 0
        pytest.fail(f"README command failed (exit {r.returncode}):\n{run[last][0]}\n--- output:\n"
                    f"{outputs.get(last, '')}\n--- stderr:\n{r.stderr[-3000:]}")  # fmt: skip
    assert len(outputs) == len(run)
    for i, (cmd, shown) in enumerate(run):  # the output README shows: same fields, same values but ids
        if shown:
            want = json.loads(shown[: shown.rindex("}") + 1])
            got = json.loads(outputs[i].strip().splitlines()[0])
            assert set(got) == set(want), f"{cmd}\nREADME shows {want}, got {got}"
            assert {k: v for k, v in got.items() if "id" not in k} == {
                k: v for k, v in want.items() if "id" not in k
            }, f"{cmd}\nREADME shows {want}, got {got}"
    # what the commands did: both jobs submitted, then consumed whole by loop.py
    jobs = httpx.get(f"{up.api}/v1/jobs", timeout=30, headers=up.headers).json()
    assert len(jobs) == 2 and all(j["done"] and j["counts"]["failed"] == 0 for j in jobs), jobs
    loop_out = next(outputs[i] for i, (c, _) in enumerate(run) if "loop.py" in c)
    assert len([ln for ln in loop_out.splitlines() if ln.strip()]) == sum(j["counts"]["consumed"] for j in jobs)
    assert "hsstream_samples_total" in "".join(outputs.values())
    # the links README gives into the running stack (/docs) answer
    links = set(re.findall(rf"<http://{DEFAULT_API}(/[^>]*)>", README.read_text()))
    assert "/docs" in links
    for path in links:
        assert httpx.get(f"{up.api}{path}", timeout=30, headers=up.headers).status_code == 200, path
    # README's Ctrl-C note: the stack stops cleanly (SIGTERM here; test_up sends SIGINT)
    mark = len(up.output().splitlines())
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(180) == 0, up.tail()
    assert_stopped_cleanly(up.output().splitlines()[mark:], "SIGTERM", children=("vllm", "sidecar"))
    assert not up.spool.exists()
