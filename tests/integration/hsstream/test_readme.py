"""Every command in README.md, run as a reader would run it, against the stack README starts.

The fenced ``sh`` blocks are split into commands; each one is either run, or listed in
EXCLUDED with the reason it cannot run here (so a new command is run unless someone says why
not). README's own ``.venv/bin/hsstream up --model smollm2`` is the stack (the real model, as
README says; the ``smollm2`` fixture fetches it once, as README's ``hsstream models get`` does):
started first, stopped with SIGTERM when README says to stop it (before ``hsstream eval``, the
commands AFTER_STOP), and that stop must read as clean. The others run in README's order in one
shell per phase (``set -e``: later commands use ``$DATA`` and ``$JOB``), in a scratch folder
with the clone's ``.venv`` and a copy of ``deploy/``; a command that fails fails the test with
its output. Where README shows a command's output (``# {...}``), the output must have the same
fields, and the same values but for ids.

Only the port and the stack's folders differ from what a reader gets: ``localhost:8100``
(the default ``HSSTREAM_PORT``) becomes a free port, and the ``HSSTREAM_*`` variables point
all commands at this test's stack.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import CPU_BUILD_EXECUTOR
from tests.integration.hsstream.test_up import START_TIMEOUT, Up, assert_stopped_cleanly

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DEFAULT_API = "localhost:8100"
STACK = ".venv/bin/hsstream up --model smollm2"
#: README stops the stack before these (one vLLM engine at a time on a small machine).
AFTER_STOP = r"^\.venv/bin/hsstream eval "

#: Commands not run here, by a pattern that matches them, and why.
EXCLUDED = {
    r"^make demo\b": "`make` (re)installs .venv; `make demo` runs the same path at its own size (docs/real-model.md)",
    r"^make test\b": "`make` (re)installs .venv, and runs this very test",
    r"^pip install '\.\[gpu,trainer,server\]'": "vLLM's CUDA build: resolved by pip --dry-run only (docs/dependencies.md)",
    r"^CUDA_VISIBLE_DEVICES=": "a GPU host's model and GPUs; the same commands run above on the CPU with SmolLM2",
    r"^JOB=\$\(hsstream submit train\.jsonl": "the GPU host's block (its train.jsonl); `hsstream submit` runs above",
    r"^vllm serve /models/": "a GPU host's model; `hsstream eval` above serves the same --speculative-config here",
    r"^deploy/make-env\.sh": "compose block: needs Docker; make compose-smoke runs compose (docs/deploy.md)",
    r"^printf 'TRAIN_ARGS=": "compose block: edits deploy/.env for Docker; test_compose_trainer.py checks TRAIN_ARGS",
    r"^docker compose ": "Docker and GPUs; compose's file is checked by test_deploy_compose.py",
    r"^hsstream proxy serve ": "a server until Ctrl-C in front of a serving vLLM; test_proxy_vllm.py runs it",
    r"^hsstream train --follow ": "live traffic: trains with no end; the live-traffic tests run it (docs/live-traffic.md)",
    r"^hsstream proxy swap ": "needs the proxy above and its serving vLLM; the proxy's swap tests run it",
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


def readme_plan() -> tuple[list[tuple[str, str | None]], list[tuple[str, str | None]], list[str]]:
    """(commands to run with the stack up, in order; those to run after it stops; the commands excluded)."""
    run, after, skipped, seen = [], [], [], set()
    for lang, body in blocks(README.read_text()):
        if lang in ("sh", "bash", "shell"):
            for cmd, shown in commands(body):
                why = excluded(cmd)
                seen.update(p for p in EXCLUDED if re.search(p, cmd))
                if why:
                    skipped.append(cmd)
                elif after or re.search(AFTER_STOP, cmd):
                    after.append((cmd, shown))
                elif cmd.split("#")[0].strip() != STACK:
                    run.append((cmd, shown))
    stale = set(EXCLUDED) - seen
    assert not stale, f"exclusions that match no README command any more: {stale}"
    return run, after, skipped


def test_readme_plan_runs_every_command_but_the_listed_ones():
    run, after, skipped = readme_plan()
    text = README.read_text()
    assert STACK in text and "make demo" in text and "make test" in text
    cmds = [c for c, _ in run]
    assert cmds[:2] == [".venv/bin/hsstream models get smollm2", ".venv/bin/hsstream data get sharegpt"] or \
        [c.split("#")[0].strip() for c in cmds[:2]] == [".venv/bin/hsstream models get smollm2",
                                                        ".venv/bin/hsstream data get sharegpt"]  # fmt: skip
    assert any(c.startswith("JOB=$(.venv/bin/hsstream submit ") and "--preset sharegpt" in c for c in cmds)
    assert any(c.startswith(".venv/bin/hsstream train ") for c in cmds)
    assert any("/metrics" in c for c in cmds) and any("hsstream top --once" in c for c in cmds)
    assert [c for c, _ in after] and all(re.search(AFTER_STOP, c) for c, _ in after), after
    assert any("--speculative-config" in c for c in skipped)  # the serve line is shown, run through eval
    assert "localhost:8100/docs" in text


@pytest.fixture(scope="module")
def stack(smollm2, tmp_path_factory):
    """README's `.venv/bin/hsstream up --model smollm2`, verbatim, in a scratch folder."""
    tmp = tmp_path_factory.mktemp("readme")
    work = tmp / "clone"
    work.mkdir()
    # the clone's .venv (a worktree without one: the venv running this test, as sys.prefix says)
    (work / ".venv").symlink_to(ROOT / ".venv" if (ROOT / ".venv").exists() else Path(sys.prefix))
    shutil.copytree(ROOT / "deploy", work / "deploy")
    # the model and its layers are README's (--model smollm2, Eagle-3's default layers), not the test stack's
    up = Up(tmp, "smollm2", command=[str(work / shlex.split(STACK)[0]), *shlex.split(STACK)[1:]], cwd=work,
            env_changes={"HSSTREAM_MODEL": None, "HSSTREAM_LAYER_IDS": None,  # as a user has them
                         "HSSTREAM_NOTICE_TIMEOUT_S": None,
                         # the tests' one-process vLLM (tests/conftest.py), for README's engines too:
                         # test_up proves `hsstream up` in the CPU build's own topology
                         **{k: "0" for k in CPU_BUILD_EXECUTOR}})  # fmt: skip
    try:
        up.wait_for("stack ready", START_TIMEOUT)
        yield up, work
    finally:
        up.kill()


def run_phase(cmds: list[tuple[str, str | None]], work: Path, env: dict, port: str, prelude: str = "") -> dict[int, str]:
    """Run README commands in one shell; each one's output by its index. A failure fails the test."""
    script = ["set -euo pipefail", prelude]
    for i, (cmd, _shown) in enumerate(cmds):
        script += [f"echo '@@ {i}'", cmd.replace(DEFAULT_API, f"localhost:{port}"), "echo"]
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True,
                       timeout=1800)  # fmt: skip
    parts = re.split(r"^@@ (\d+)\n", r.stdout, flags=re.M)[1:]
    outputs = {int(parts[i]): parts[i + 1] for i in range(0, len(parts), 2)}
    if r.returncode != 0:
        last = max(outputs) if outputs else 0
        pytest.fail(f"README command failed (exit {r.returncode}):\n{cmds[last][0]}\n--- output:\n"
                    f"{outputs.get(last, '')}\n--- stderr:\n{r.stderr[-3000:]}")  # fmt: skip
    assert len(outputs) == len(cmds)
    for i, (cmd, shown) in enumerate(cmds):  # the output README shows: same fields, same values but ids
        if shown:
            want = json.loads(shown[: shown.rindex("}") + 1])
            got = json.loads(outputs[i].strip().splitlines()[0])
            assert set(got) == set(want), f"{cmd}\nREADME shows {want}, got {got}"
            assert {k: v for k, v in got.items() if "id" not in k} == {
                k: v for k, v in want.items() if "id" not in k
            }, f"{cmd}\nREADME shows {want}, got {got}"
    return outputs


def test_every_readme_command_runs_against_the_stack(stack):
    up, work = stack
    run, after, _ = readme_plan()
    port = str(up.api_port)
    env = {**up.env, "PYTHONUNBUFFERED": "1"}
    outputs = run_phase(run, work, env, port)
    # what the commands did: the job submitted, consumed whole by `hsstream train`, its draft written
    jobs = httpx.get(f"{up.api}/v1/jobs", timeout=30, headers=up.headers).json()
    assert len(jobs) == 1 and jobs[0]["done"] and jobs[0]["counts"]["failed"] == 0, jobs
    assert jobs[0]["counts"]["consumed"] >= 1, jobs
    assert (work / "runs/smollm2/final/config.json").exists()
    train_out = next(outputs[i] for i, (c, _) in enumerate(run) if c.startswith(".venv/bin/hsstream train "))
    assert "vllm serve" in train_out and "--speculative-config" in train_out, train_out[-2000:]
    assert "hsstream_samples_total" in "".join(outputs.values())
    # the links README gives into the running stack (/docs) answer
    links = set(re.findall(rf"<http://{DEFAULT_API}(/[^>]*)>", README.read_text()))
    assert "/docs" in links
    for path in links:
        assert httpx.get(f"{up.api}{path}", timeout=30, headers=up.headers).status_code == 200, path
    # README: stop the stack (Ctrl-C: SIGTERM here; test_up sends SIGINT), then measure the draft
    mark = len(up.output().splitlines())
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(180) == 0, up.tail()
    assert_stopped_cleanly(up.output().splitlines()[mark:], "SIGTERM", children=("vllm", "sidecar"))
    assert not up.spool.exists()
    # the variables the reader's second terminal still holds (README's earlier block set them)
    prelude = next(c for c, _ in run if c.startswith("DATA="))
    out = run_phase(after, work, env, port, prelude=prelude)
    text = "".join(out.values())
    assert "acceptance" in text.lower() and "tokens/s" in text, text[-3000:]
