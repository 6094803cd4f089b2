"""``--logger tensorboard,wandb,none``: a logger asked for is used, or the run stops before it starts.

Neither package is installed here; their presence is faked (``find_spec``) and W&B is a recording
stand-in module, so what is checked is the choice, the errors and what reaches the logger.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from connector import protocol as P
from hsstream.cli import app
from hsstream.tiny_model import hf_hidden_states
from trainer_client.eagle3 import Eagle3OnlineTrainer, TrainConfig
from trainer_client.train import loggers as L
from trainer_client.stream import Sample


def _installed(monkeypatch, *present: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(L.importlib.util, "find_spec",
                        lambda name, *a: object() if name in present else (None if name in L.PACKAGES else real(name, *a)))  # fmt: skip


def test_names_parse_check_packages_and_keep_the_old_default(monkeypatch):
    _installed(monkeypatch, "tensorboard", "wandb")
    assert L.names("tensorboard, wandb,tensorboard") == ["tensorboard", "wandb"]
    assert L.names("none") == [] and L.names("") == []
    assert L.names(None) == ["tensorboard"] and L.names(None, tensorboard=False) == []
    _installed(monkeypatch)
    assert L.names(None) == []  # not asked for: silently none, as before
    with pytest.raises(L.LoggerError, match="'wandb' asked for, but its package is not installed: pip install wandb"):
        L.names("wandb")
    with pytest.raises(L.LoggerError, match="pip install tensorboard"):
        L.names("none,tensorboard")
    with pytest.raises(L.LoggerError, match="'mlflow': speculators has it"):
        L.names("mlflow")
    with pytest.raises(L.LoggerError, match="'tb': use tensorboard, wandb or none"):
        L.names("tb")


def test_hsstream_train_with_a_missing_logger_stops_at_once_naming_the_package(monkeypatch, tmp_path):
    import hsstream.launch

    _installed(monkeypatch)
    monkeypatch.setattr(hsstream.launch, "exit_0_on_stop", lambda: None)
    r = CliRunner().invoke(app, ["train", "--model", "/m", "--out", str(tmp_path / "r"), "--job", "j", "--logger", "wandb"])
    assert r.exit_code == 2 and "pip install wandb" in r.output, r.output
    assert not (tmp_path / "r").exists()  # nothing submitted, nothing written


def test_wandb_gets_every_logged_step_and_the_run_resumes_the_same_wandb_run(monkeypatch, tmp_path, tiny_model):
    calls: list[tuple] = []

    class Run:
        def log(self, d, step):  # noqa: ANN001
            calls.append(("log", step, dict(d)))

        def finish(self) -> None:
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    _installed(monkeypatch, "wandb")
    layers = [2, 6, 9, 12]
    rng = random.Random(0)
    samples = []
    for i in range(6):
        ids = [rng.randrange(0, 64) for _ in range(24)]
        hs = hf_hidden_states(tiny_model, ids, layers).to(torch.bfloat16)
        samples.append(Sample(P.SampleKey(job="unit", index=i), torch.tensor(ids), hs, layers, 12, None))

    class Stream(list):
        def ack_through(self, key) -> None:  # noqa: ANN001
            pass

    def run(n: int):  # noqa: ANN202
        cfg = TrainConfig(verifier=tiny_model, out_dir=str(tmp_path), draft_vocab_size=128, checkpoint_every=3,
                          progress=False, log_every=1, warmup_steps=1, threads=1, logger="wandb")  # fmt: skip
        return Eagle3OnlineTrainer(cfg, {t: 1 for t in range(64)}).train(Stream(samples[:n]))

    run(3)
    inits = [c for c in calls if c[0] == "init"]
    assert len(inits) == 1 and inits[0][1]["resume"] == "allow" and inits[0][1]["config"]["logger"] == "wandb"
    logged = [c for c in calls if c[0] == "log"]
    assert [c[1] for c in logged] == [1, 2, 3] and {"train/loss", "train/lr", "train/top1_0"} <= set(logged[0][2])
    assert calls[-1] == ("finish",)
    assert not (tmp_path / "tensorboard").exists()  # only what was asked for
    run(6)  # resumed in the same run dir: the same W&B run
    inits = [c for c in calls if c[0] == "init"]
    assert len(inits) == 2 and inits[1][1]["id"] == inits[0][1]["id"]
