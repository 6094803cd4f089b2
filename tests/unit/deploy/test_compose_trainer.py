"""What compose's trainer service trains: its entry script (``deploy/compose.yaml``, ``x-trainer``)
run for real by ``sh`` with each service's resolved environment, a stand-in ``hsstream`` on
PATH recording the command line it would exec; that line parsed by our CLI, and with a run's
settings file, resolved by ``hsstream train --dump-config`` (flag > file > default)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from hsstream.cli import app
from tests.unit.deploy.test_deploy_compose import PROFILES, mounts, resolved, role

FAKE = "#!/bin/sh\nexec python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n"


def entry(svc: dict, tmp: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """The service's entrypoint (``sh -c SCRIPT NAME``) as the container runs it, with ``args``
    as the service's arguments, its environment plus ``env``, and ``hsstream`` recording argv."""
    ep = svc["entrypoint"]
    assert ep[:2] == ["sh", "-c"], ep
    script = ep[2].replace("$$", "$")  # compose's escape, as `config` prints it (the container gets one $)
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "hsstream"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    full = {"PATH": f"{bindir}:{os.environ['PATH']}", **{k: str(v) for k, v in svc["environment"].items()}, **env}
    return subprocess.run(["sh", "-c", script, *ep[3:], *args], env=full, capture_output=True, text=True, timeout=30)


def argv_of(svc: dict, tmp: Path, env: dict[str, str] | None = None, *args: str) -> list[str]:
    p = entry(svc, tmp, env or {}, *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def parses(a: list[str]) -> dict:
    assert a[0] == "train", a
    cmd = typer.main.get_command(app).commands["train"]
    with cmd.make_context("hsstream train", a[1:], resilient_parsing=False) as ctx:
        return dict(ctx.params)


@pytest.mark.parametrize("profile", PROFILES)
def test_defaults_train_on_the_data_file_into_the_checkpoint_folder(profile, tmp_path):
    _, svc = role(resolved(profile), "trainer")
    a = argv_of(svc, tmp_path)
    p = parses(a)
    run, submit = svc["environment"]["TRAIN_RUN"], svc["environment"]["TRAIN_SUBMIT"]
    assert p["out"] == f"/checkpoints/{run}" and p["submit"] == submit and p["config"] is None
    assert submit == ("/opt/hsstream/demo.jsonl" if profile == "cpu" else "/data/train.jsonl")
    # the checkpoints are in a host folder (a bind mount), not a named volume to copy out of
    target = mounts(svc)["/checkpoints"]
    assert Path(target).is_absolute() and target.endswith("/deploy/checkpoints"), target
    assert mounts(svc)["/config"].endswith("/deploy/config")
    assert "checkpoints" not in (resolved(profile).get("volumes") or {})
    # `hsstream train`'s default API is the sidecar's service
    assert (svc["environment"]["HSSTREAM_HOST"], svc["environment"]["HSSTREAM_PORT"]) == ("sidecar", "8100")


def test_a_run_file_and_train_args_decide_the_run_flags_winning(tmp_path, monkeypatch):
    """TRAIN_CONFIG names a file in the mounted folder: the defaults go, the file's settings
    hold, TRAIN_ARGS (shell-quoted words, ranks included) win over it."""
    _, svc = role(resolved("default"), "trainer")
    cfg_dir = tmp_path / "config"
    cfg_dir.mkdir()
    (cfg_dir / "run.yaml").write_text(yaml.safe_dump({
        "out_dir": "/checkpoints/exp1", "submit": "/data/chats.jsonl", "epochs": 2, "lr": 0.0005,
        "draft": "eagle3", "nproc": 1, "verifier": "/model",
    }))  # fmt: skip
    a = argv_of(svc, tmp_path, {"TRAIN_CONFIG": "run.yaml",
                                "TRAIN_ARGS": "--nproc 2 --lr 3e-4 --eval-ids 'a b,c'"})  # fmt: skip
    assert a == ["train", "--config", "/config/run.yaml", "--nproc", "2", "--lr", "3e-4", "--eval-ids", "a b,c"]
    local = [x.replace("/config/", f"{cfg_dir}/") for x in a]
    for k in [k for k in os.environ if k.startswith("HSSTREAM_") or k in ("WORLD_SIZE", "RANK")]:
        monkeypatch.delenv(k)
    r = CliRunner().invoke(app, [*local, "--dump-config"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    got = yaml.safe_load(r.stdout)
    assert (got["out_dir"], got["submit"], got["epochs"]) == ("/checkpoints/exp1", "/data/chats.jsonl", 2)
    assert got["lr"] == 3e-4 and got["nproc"] == 2  # TRAIN_ARGS over the file


def test_the_services_own_arguments_replace_the_defaults_and_bad_train_args_stop_it(tmp_path):
    _, svc = role(resolved("cpu"), "trainer")
    a = argv_of(svc, tmp_path, {"TRAIN_ARGS": "--nproc 2"}, "--out", "/checkpoints/smoke", "--job", "j1")
    assert a == ["train", "--out", "/checkpoints/smoke", "--job", "j1", "--nproc", "2"]
    assert parses(a)["nproc"] == 2
    p = entry(svc, tmp_path, {"TRAIN_ARGS": "--lr 'unclosed"})
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
