"""``hsstream train --config FILE``: every setting from a YAML or TOML file, flags winning.

The command runs up to ``run_train``, which is replaced: what is checked is the configuration
and run settings training would have started with.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from typer.testing import CliRunner

from hsstream import train_config as TC
from hsstream.cli import app
from trainer_client.train.config import TrainConfig

#: Every TrainConfig field at a value that is not its default (out_dir: the test's tmp dir).
NON_DEFAULT = {
    "verifier": "/models/v", "aux_layer_ids": [1, 3, 5], "draft_vocab_size": 77, "ttt_steps": 4,
    "ttt_step_loss_decay": 0.8, "lr": 0.02, "min_lr_ratio": 0.05, "warmup_steps": 7, "schedule": "linear",
    "schedule_steps": 123, "max_steps": 99, "weight_decay": 0.01, "betas": (0.8, 0.9), "grad_clip": 0.5,
    "samples_per_step": 3, "max_tokens_per_step": 2048, "checkpoint_every": 11, "checkpoint_every_s": 30.0,
    "clock_origin": 1234.5, "keep_checkpoints": 5, "eval_every": 6, "eval_samples": 4, "eval_ids": ("a", "b c"), "eval_fraction": 0.25, "eval_seed": 9,
    "log_every": 3, "seed": 42, "train_lm_head": True, "control": "swap-hidden", "tensorboard": False, "logger": "none",
    "progress": False, "threads": 2, "device": "cpu", "autocast": "none", "prefetch": 2, "idle_s": 0.5, "init_draft": "/drafts/d0",
    "draft_attn_impl": "eager", "extra": {"note": "x"}, "draft": "dflash", "mask_token_id": 7, "block_size": 5,
    "num_depths": 3, "max_anchors": 17, "num_draft_layers": 2, "markov_rank": 32, "confidence_head_alpha": 0.5,
}  # fmt: skip
RUN = {"jobs": ["j1", "j2"], "submit": "data.jsonl", "epochs": 3, "loss_mask": "all", "api": "http://h:1",
       "endpoint": "tcp://h:2", "spool": "/s", "token_counts": "tc.json", "timeout": 9.0}  # fmt: skip


@pytest.fixture
def train(monkeypatch):
    """``hsstream train ARGS`` → (exit code, output, the cfg and run_train's keyword arguments)."""
    import hsstream.launch
    import trainer_client.train.run as R

    got: dict = {}

    class Result:
        serve = final_dir = serve_refused = None

        def summary(self) -> dict:
            return {}

    def fake_run_train(cfg, **kw):  # noqa: ANN001, ANN003, ANN202
        got.update(cfg=cfg, **kw)
        return Result()

    monkeypatch.setattr(R, "run_train", fake_run_train)
    monkeypatch.setattr(hsstream.launch, "exit_0_on_stop", lambda: None)  # leave pytest's signal handlers
    monkeypatch.delenv("HSSTREAM_MODEL", raising=False)

    def call(*args: str):  # noqa: ANN202
        r = CliRunner().invoke(app, ["train", *args])
        return r.exit_code, r.output, got

    return call


def _write(path, data: dict) -> str:  # noqa: ANN001
    if path.suffix == ".toml":
        def val(v):  # noqa: ANN001, ANN202
            if isinstance(v, dict):
                return "{ " + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + " }"
            if isinstance(v, list | tuple):
                return "[" + ", ".join(val(x) for x in v) + "]"
            return json.dumps(v)  # strings, numbers, true/false: TOML reads JSON's spelling of them

        path.write_text("".join(f"{k} = {val(v)}\n" for k, v in data.items()))
    else:
        path.write_text(yaml.safe_dump(json.loads(json.dumps(data))))
    return str(path)


def setting(cfg, name: str):  # noqa: ANN001, ANN201
    """A setting of the run: a TrainConfig field, or a draft's own (in ``draft_options``)."""
    return cfg.draft_options[name] if name in TC.draft_keys() else getattr(cfg, name)


def test_the_table_covers_every_field_at_a_value_that_is_not_its_default():
    from trainer_client import drafts

    fields = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "draft_options"}
    assert set(NON_DEFAULT) | {"out_dir"} == set(fields) | set(TC.draft_keys()), \
        "a new TrainConfig field or draft setting needs a value here (and a key)"  # fmt: skip
    for name, v in NON_DEFAULT.items():
        if name in TC.draft_keys():
            assert all(v != spec.default for _, spec in drafts.option_table()[name]), name
            continue
        f = fields[name]
        if f.default is not dataclasses.MISSING:
            assert v != f.default, name
        elif f.default_factory is not dataclasses.MISSING:
            assert v != f.default_factory(), name


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_config_file_round_trips_every_field(train, tmp_path, suffix):
    out = str(tmp_path / "run")
    path = _write(tmp_path / f"train{suffix}", {**NON_DEFAULT, "out_dir": out, **RUN})
    code, output, got = train("--config", path)
    assert code == 0, output
    cfg = got["cfg"]
    for name, want in {**NON_DEFAULT, "out_dir": out}.items():
        have = setting(cfg, name)
        if name == "extra":
            assert have["note"] == "x" and have["config"] == path and "argv" in have
        else:
            assert have == want and type(have) is type(want), name
    assert got["jobs"] == ["j1", "j2"] and got["submit_file"] == "data.jsonl" and got["epochs"] == 3
    assert got["job_options"] == {"loss_mask": "all", "on_invalid": "skip"} and got["api"] == "http://h:1" and got["endpoint"] == "tcp://h:2"
    assert got["spool_dir"] == "/s" and got["token_counts_file"] == "tc.json" and got["timeout_s"] == 9.0


def test_dump_config_writes_a_file_that_reads_back_the_same(train, tmp_path):
    path = _write(tmp_path / "a.yaml", {**NON_DEFAULT, "out_dir": str(tmp_path / "run"), **RUN})
    code, dumped, got = train("--config", path, "--lr", "0.3", "--dump-config")
    assert code == 0, dumped
    assert "cfg" not in got  # nothing started
    again = tmp_path / "b.yaml"
    again.write_text(dumped)
    code, output, got = train("--config", str(again))
    assert code == 0, output
    run = {k: v for k, v in NON_DEFAULT.items() if k not in TC.draft_keys()}
    want = TrainConfig(**{**run, "out_dir": str(tmp_path / "run"), "lr": 0.3},
                       draft_options={k: v for k, v in NON_DEFAULT.items() if k in TC.draft_keys()})  # fmt: skip
    assert {k: v for k, v in dataclasses.asdict(got["cfg"]).items() if k != "extra"} == \
        {k: v for k, v in dataclasses.asdict(want).items() if k != "extra"}  # fmt: skip


def test_flags_override_the_file_and_the_file_overrides_defaults(train, tmp_path):
    path = _write(tmp_path / "c.yaml", {"model": "/m", "out": str(tmp_path / "r"), "lr": 0.5, "steps": 40,
                                         "progress": False, "threads": 4, "epochs": 2})  # fmt: skip
    code, output, got = train("--config", path, "--lr", "0.01", "--max-steps", "9", "--progress")
    assert code == 0, output
    cfg = got["cfg"]
    assert (cfg.lr, cfg.max_steps, cfg.progress) == (0.01, 9, True)  # flags (one by speculators' name)
    assert (cfg.threads, got["epochs"], cfg.verifier) == (4, 2, "/m")  # the file
    assert (cfg.seed, cfg.warmup_steps, cfg.samples_per_step) == (0, 20, 1)  # the CLI's defaults


@pytest.mark.parametrize("body, named", [
    ({"lr": 0.1, "learning_rate": 0.1}, "'learning_rate'"),
    ({"optimizer": {"lr": 0.1, "lrr": 1}}, "'optimizer.lrr'"),
    ({"train": {"num_workers": 4}}, "'num_workers'"),
])  # fmt: skip
def test_an_unknown_key_is_refused_naming_it(train, tmp_path, body, named):
    code, output, got = train("--config", _write(tmp_path / "d.yaml", {"model": "/m", "out": "r", **body}))
    assert code == 2 and "unknown key" in output and named in output, output
    assert "cfg" not in got


def test_a_bad_value_or_a_missing_verifier_is_a_clear_error(train, tmp_path):
    code, output, _ = train("--config", _write(tmp_path / "e.yaml", {"model": "/m", "out": "r", "lr": "fast"}))
    assert code == 2 and "lr" in output and "'fast' is not a number" in output, output
    code, output, _ = train("--config", _write(tmp_path / "f.yaml", {"out": "r"}))
    assert code == 2 and "no verifier" in output, output
    code, output, _ = train("--config", _write(tmp_path / "g.toml", {"model": "/m", "out": "r"}) + "x")
    assert code == 2 and "cannot read" in output, output
    (tmp_path / "h.yaml").write_text("lr: [0.1\n")
    code, output, _ = train("--config", str(tmp_path / "h.yaml"))
    assert code == 2 and "not valid YAML" in output, output
    (tmp_path / "i.toml").write_text("lr = \n")
    code, output, _ = train("--config", str(tmp_path / "i.toml"))
    assert code == 2 and "not valid TOML" in output, output


def test_a_held_out_fraction_outside_0_1_is_refused_before_the_run(train, tmp_path):
    code, output, got = train("--model", "/m", "--out", str(tmp_path / "r"), "--eval-fraction", "1")
    assert code == 2 and "eval fraction must be in [0, 1)" in output and "cfg" not in got, output
    code, output, got = train("--model", "/m", "--out", str(tmp_path / "r"), "--eval-fraction", "0.1", "--eval-seed", "4")
    assert code == 0 and (got["cfg"].eval_fraction, got["cfg"].eval_seed) == (0.1, 4), output


def test_speculators_names_and_run_yaml_layout_are_understood(train, tmp_path):
    run_yaml = {"train": {
        "verifier": {"verifier_name_or_path": "/m"},
        "draft": {"target_layer_ids": [2, 4, 6], "draft_vocab_size": 100, "draft_attn_impl": "sdpa"},
        "data": {"total_seq_len": 1024},
        "loss": {"ttt_steps": 2, "ttt_step_loss_decay": 0.9},
        "optimizer": {"lr": 3e-4, "weight_decay": 0.05},
        "scheduler": {"scheduler_type": "none", "scheduler_warmup_steps": 5, "scheduler_total_steps": 500},
        "trainer": {"epochs": 4, "save_path": str(tmp_path / "r"), "max_steps": 600, "log_freq": 2},
        "seed": 7,
    }}  # fmt: skip
    code, output, got = train("--config", _write(tmp_path / "run.yaml", run_yaml))
    assert code == 0, output
    c = got["cfg"]
    assert (c.verifier, c.aux_layer_ids, c.draft_vocab_size, c.max_tokens_per_step) == ("/m", [2, 4, 6], 100, 1024)
    assert (setting(c, "ttt_steps"), setting(c, "ttt_step_loss_decay"), c.lr, c.weight_decay) == (2, 0.9, 3e-4, 0.05)
    assert (c.schedule, c.warmup_steps, c.schedule_steps) == ("constant", 5, 500)
    assert (c.out_dir, c.max_steps, c.log_every, c.seed, got["epochs"]) == (str(tmp_path / "r"), 600, 2, 7, 4)


def test_the_draft_and_its_settings_in_our_layout_and_in_speculators(train, tmp_path):
    code, output, got = train("--config", _write(tmp_path / "a.yaml", {"verifier": "/m", "out_dir": str(tmp_path / "a"),
                                                                       "draft": "peagle", "mask_token_id": 5}))  # fmt: skip
    assert code == 0, output
    assert (got["cfg"].draft, got["cfg"].draft_options) == ("peagle", {"mask_token_id": 5})
    run_yaml = {"train": {
        "speculator_type": "dflash", "verifier": {"verifier_name_or_path": "/m"},
        "draft": {"mask_token_id": 7, "num_layers": 2}, "data": {"max_anchors": 9},
        "dflash": {"block_size": 6}, "peagle": {"num_depths": 2}, "trainer": {"save_path": str(tmp_path / "r")},
    }}  # fmt: skip
    code, output, got = train("--config", _write(tmp_path / "run.yaml", run_yaml), "--block-size", "5")
    assert code == 0, output
    c = got["cfg"]
    assert (c.draft, c.draft_options) == ("dflash", {"mask_token_id": 7, "num_draft_layers": 2, "max_anchors": 9,
                                                     "block_size": 5, "num_depths": 2})  # fmt: skip
    dspark = {"train": {"speculator_type": "dspark", "verifier": {"verifier_name_or_path": "/m"},
                        "dspark": {"markov_rank": 64, "confidence_head_alpha": 0.25},
                        "trainer": {"save_path": str(tmp_path / "s")}}}  # fmt: skip
    code, output, got = train("--config", _write(tmp_path / "dspark.yaml", dspark), "--markov-rank", "16")
    assert code == 0, output
    c = got["cfg"]
    assert (c.draft, c.draft_options) == ("dspark", {"markov_rank": 16, "confidence_head_alpha": 0.25})


def test_speculators_flag_names_work_beside_ours(train, tmp_path):
    code, output, got = train(
        "--verifier-name-or-path", "/m", "--save-path", str(tmp_path / "r"), "--max-steps", "5", "--lr", "0.2",
        "--total-seq-len", "512", "--scheduler-type", "linear", "--scheduler-warmup-steps", "3",
        "--scheduler-total-steps", "50", "--target-layer-ids", "1,2,3", "--log-freq", "4", "--weight-decay", "0.1",
    )  # fmt: skip
    assert code == 0, output
    c = got["cfg"]
    assert (c.verifier, c.out_dir, c.max_steps, c.lr, c.max_tokens_per_step) == ("/m", str(tmp_path / "r"), 5, 0.2, 512)
    assert (c.schedule, c.warmup_steps, c.schedule_steps, c.aux_layer_ids, c.log_every, c.weight_decay) == \
        ("linear", 3, 50, [1, 2, 3], 4, 0.1)  # fmt: skip


def test_every_old_flag_still_works(train, tmp_path):
    code, output, got = train(
        "--model", "/m", "--out", str(tmp_path / "r"), "--job", "a", "--job", "b", "--epochs", "2",
        "--loss-mask", "all", "--draft-vocab-size", "64", "--aux-layers", "2,6,9", "--steps", "10",
        "--samples-per-step", "2", "--warmup", "1", "--schedule", "constant", "--schedule-steps", "8",
        "--grad-clip", "0.7", "--ttt-steps", "2", "--checkpoint-every", "3", "--checkpoint-every-s", "5",
        "--keep-checkpoints", "0", "--eval-every", "2", "--eval-samples", "1", "--eval-ids", "x,y", "--threads", "2",
        "--timeout", "30", "--seed", "3", "--control", "swap-hidden", "--no-progress", "--device", "cpu",
        "--autocast", "none", "--prefetch", "0", "--api", "http://a", "--endpoint", "tcp://e", "--spool", "/sp",
        "--token-counts", "t.json",
    )  # fmt: skip
    assert code == 0, output
    c = got["cfg"]
    assert (c.aux_layer_ids, c.eval_ids, c.max_steps, c.warmup_steps, c.progress, c.keep_checkpoints) == \
        ([2, 6, 9], ("x", "y"), 10, 1, False, 0)  # fmt: skip
    assert got["jobs"] == ["a", "b"] and got["epochs"] == 2 and got["timeout_s"] == 30.0


def test_schedule_names_are_checked():
    with pytest.raises(TC.ConfigFileError, match="schedule 'cosin'"):
        TC.merge({"verifier": "/m", "out_dir": "r"}, {"schedule": "cosin"}, {})
