"""``hsstream --help`` as a user reads it in an 80-column terminal: every command and option
says what it is for, and no option or variable name is cut (rich's narrow panels used to print
"--gpu-memory-uti…" and "HSSTREAM_LAYER_I…")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from hsstream.cli import app

ROOT = Path(__file__).resolve().parents[3]
COMMAND = typer.main.get_command(app)
SUBCOMMANDS = sorted(COMMAND.commands)
#: Variable names in help texts: HSSTREAM_* settings and compose's .env keys.
VAR = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]\b")


def help_text(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    env.pop("LINES", None)
    r = subprocess.run([sys.executable, "-m", "hsstream", *args, "--help"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def whole(name: str, text: str) -> bool:
    """``name`` occurs with no name character glued to either side (so not cut, not a prefix)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def params(cmd):  # noqa: ANN001, ANN201 - typer vendors its own click
    return [p for p in cmd.params if p.name != "help"]


def test_every_command_and_option_has_a_one_line_description():
    missing = []
    for name in SUBCOMMANDS:
        cmd = COMMAND.commands[name]
        first = (cmd.help or "").strip().splitlines()[0] if cmd.help else ""
        if not first:
            missing.append(name)
        for p in params(cmd):
            if not (getattr(p, "help", None) or "").strip():
                missing.append(f"{name} {p.opts[0]}")
    assert missing == [], f"no description: {missing}"


def test_root_help_lists_every_command_with_its_whole_first_line():
    out = help_text()
    assert max(map(len, out.splitlines())) <= 80, out
    for name in SUBCOMMANDS:
        first = COMMAND.commands[name].help.strip().splitlines()[0]
        assert re.search(rf"^  {name}\s+{re.escape(first)}$", out, re.M), f"{name}: {first!r} not whole in\n{out}"


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help_at_80_columns_cuts_no_name(name):
    cmd = COMMAND.commands[name]
    out = help_text(name)
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, out
    assert "…" not in out, out
    names = [o for p in params(cmd) for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
    variables = set()
    for p in params(cmd):
        variables.update(VAR.findall(getattr(p, "help", None) or ""))
        envvar = getattr(p, "envvar", None)
        variables.update([envvar] if isinstance(envvar, str) else envvar or [])
    variables.update(VAR.findall(cmd.help or ""))
    cut = [n for n in [*names, *sorted(variables)] if not whole(n, out)]
    assert cut == [], f"`hsstream {name} --help` cuts {cut}:\n{out}"
    for p in params(cmd):  # each description is there, whole (re-flowed lines joined)
        flat = " ".join(out.split())
        assert " ".join((p.help or "").split()) in flat, f"{p.opts[0]}: description missing or cut:\n{out}"
