"""``bench/long_checks/compose_smoke.py``'s result handling, without an engine: its verdicts on what a run
reads (a typed ``JobStatus`` from the REST client, the host checkpoint folder, the trainer's
summary, the containers' exit codes) and its .env, resolved by Compose for the cpu profile, so
the trainer service runs the config path (``make compose-smoke`` itself takes minutes)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from bench.long_checks import compose_smoke as CS
from connector.contract.rest import JobStatus
from tests.unit.deploy.test_deploy_compose import compose_cmd


def status(done: bool = True, consumed: int = 32) -> JobStatus:
    return JobStatus(job_id="j1", done=done, counts={"consumed": consumed, "failed": 0}, num_samples=32,
                     tokens_consumed=1000, bytes_consumed=10**6, elapsed_s=30.0, tokens_per_s=33.3, errors=[],
                     errors_total=0, errors_offset=0)  # fmt: skip


def run_dir(tmp_path, steps=(10, 20, 30), ckpts=("step-00000016", "step-00000032"), final=True):
    d = tmp_path / "smoke"
    (d / "checkpoints").mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps))
    for c in ckpts:
        (d / "checkpoints" / c).mkdir()
    if final:
        (d / "final").mkdir()
        (d / "final" / "config.json").write_text("{}")
    return d


SUMMARY = "hsstream train: 2 ranks ...\n{\n  \"samples\": 32,\n  \"world_size\": 2,\n  \"ranks\": [\n    {}\n  ]\n}\n"


def test_a_good_run_passes_and_its_figures_are_recorded(tmp_path):
    got, bad = CS.train_verdict(status(), 32, run_dir(tmp_path), CS.last_json(SUMMARY), nproc=2)
    assert bad == []
    assert got["samples_consumed"] == 32 and got["train_steps"] == 30 and got["world_size"] == 2
    assert got["checkpoints"] == ["step-00000016", "step-00000032"] and got["final_draft"] is True


@pytest.mark.parametrize(("kw", "dir_kw", "summary", "nproc", "why"), [
    ({"done": False}, {}, SUMMARY, 2, "not done"),
    ({"consumed": 31}, {}, SUMMARY, 2, "31 of 32 samples consumed"),
    ({}, {"ckpts": ()}, SUMMARY, 2, "checkpoints []"),
    ({}, {"final": False}, SUMMARY, 2, "final draft missing"),
    ({}, {"steps": ()}, SUMMARY, 2, "no step"),
    ({}, {}, SUMMARY, 1, "ran 2 rank(s), 1 asked for"),
    ({}, {}, "no summary printed\n", 2, "ran None rank(s)"),
], ids=["not-done", "short", "no-checkpoints", "no-final", "no-steps", "ranks", "no-summary"])  # fmt: skip
def test_each_failure_is_named(tmp_path, kw, dir_kw, summary, nproc, why):
    _, bad = CS.train_verdict(status(**kw), 32, run_dir(tmp_path, **dir_kw), CS.last_json(summary), nproc=nproc)
    assert len(bad) == 1 and why in bad[0], bad


def test_stop_verdict():
    assert CS.stop_verdict({"a": 0, "b": 143}, 0, 0, 0) == (True, [])
    clean, bad = CS.stop_verdict({"a": 0, "b": 137}, 2, 1, 0)
    assert not clean and bad == ["exit codes {'a': 0, 'b': 137}", "2 file(s) left in the spool",
                                 "containers left 1, volumes left 0"]
    assert CS.stop_verdict({}, 0, 0, 0)[0] is False  # no container seen is no clean stop


def test_the_smoke_env_runs_the_trainer_on_its_run_file_with_two_ranks(tmp_path):
    """The .env the smoke writes, resolved by Compose: the cpu trainer mounts the smoke's host
    folders and its entry script gets --config /config/run.yaml and --nproc 2."""
    from tests.unit.deploy.test_compose_trainer import argv_of

    env_file, ck, cf = tmp_path / "smoke.env", tmp_path / "checkpoints", tmp_path / "config"
    CS.write_env(env_file, "t" * 64, "hsstream-base:bookworm", 18100, 18000, checkpoints=ck, config=cf)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "HSSTREAM_", "TRAIN_"))}
    p = subprocess.run([*compose_cmd(), "--env-file", str(env_file), "-f", str(CS.DEPLOY / "compose.yaml"),
                        "--profile", "cpu", "config"], capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0 and "is not set" not in p.stderr, p.stderr
    svc = yaml.safe_load(p.stdout)["services"]["trainer-cpu"]
    vols = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"] if isinstance(v, str)} or {
        v["target"]: v.get("source") for v in svc["volumes"]}
    assert vols["/checkpoints"] == str(ck) and vols["/config"] == str(cf)
    assert argv_of(svc, tmp_path) == ["train", "--config", "/config/run.yaml", "--nproc", "2"]
    from hsstream import train_config as TC

    rf = TC.settings(CS.run_file("job-1"))  # every key one `hsstream train --config` takes
    assert rf["jobs"] == ["job-1"] and rf["out_dir"] == "/checkpoints/smoke"
