"""A draft is one module plus one registry line: a toy draft that lives in the tests
(``toy_draft.py``), registered from here only, trains a step on the generic trainer, takes its
own setting as a flag and a config key, and is served by its own ``serve_config``, through the
trainer's serve line, ``hsstream eval``'s check and the launcher alike."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from typer.testing import CliRunner

from connector import protocol as P
from hsstream import launch
from hsstream import train_config as TC
from hsstream.cli import app
from tests.unit.trainer_client.test_trainer_loop import ListStream, counts_of
from trainer_client import drafts as D
from trainer_client.drafts import serving
from trainer_client.drafts.options import DraftOptions, option
from trainer_client.stream import Sample
from trainer_client.train.checkpoints import verifier_text_config
from trainer_client.train.trainer import OnlineTrainer, TrainConfig

TOY = "tests.unit.trainer_client.toy_draft:Toy"


@pytest.fixture
def toy(monkeypatch):
    """The one registry line, added for this test."""
    for f in (TC.draft_keys, TC.draft_aliases):
        f.cache_clear()
    monkeypatch.setitem(D.REGISTRY, "toy", TOY)
    yield
    for f in (TC.draft_keys, TC.draft_aliases):
        f.cache_clear()


def test_a_toy_draft_trains_a_step_and_is_served_by_its_own_config(toy, tiny_model, tmp_path):
    v = verifier_text_config(tiny_model)
    n, h = int(v["num_hidden_layers"]), int(v["hidden_size"])
    layers, rng = [2, 6, 9, n], random.Random(0)
    samples = []
    for i in range(2):
        ids = torch.tensor([rng.randrange(64) for _ in range(12)])
        samples.append(Sample(P.SampleKey(job="toy", index=i), ids, torch.randn(12, 4, h).to(torch.bfloat16), layers, n, None))
    out = tmp_path / "run"
    cfg = TrainConfig(verifier=tiny_model, out_dir=str(out), draft="toy", max_steps=1, draft_vocab_size=128,
                      progress=False, tensorboard=False, threads=1, draft_options={"toy_width": 3})  # fmt: skip
    res = OnlineTrainer(cfg, counts_of(samples)).train(ListStream(samples))
    final = (out / "final").resolve()
    want = {"method": "toy", "model": str(final), "num_speculative_tokens": 1, "toy_width": 3}
    assert res.steps == 1 and res.draft == "toy" and res.speculative_config == want
    assert '"method": "toy"' in res.serve and '"toy_width": 3' in res.serve
    assert json.loads((out / "run.json").read_text())["options"] == {"toy_width": 3}
    # hsstream eval and the launcher find the toy by its checkpoint and ask it
    assert serving.speculative_config(final) == want
    args = launch.vllm_args(launch.VllmOptions(model=tiny_model, layer_ids=[], spool_dir="", notice_endpoint="",
                                               extraction=False, draft=str(final)))  # fmt: skip
    assert json.loads(args[args.index("--speculative-config") + 1]) == want


def test_a_toy_drafts_setting_is_a_flag_and_a_config_key(toy, tmp_path, monkeypatch):
    import trainer_client.train.run as R

    monkeypatch.setattr(launch, "exit_0_on_stop", lambda: None)
    monkeypatch.setattr(R, "run_train", lambda cfg, **kw: pytest.fail("nothing is trained here"))
    monkeypatch.delenv("HSSTREAM_MODEL", raising=False)
    r = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0 and "--toy-width" in r.output and "toy: a test draft's width" in r.output, r.output
    base = ["train", "--model", "/m", "--out", str(tmp_path / "r"), "--draft", "toy", "--dump-config"]
    r = CliRunner().invoke(app, [*base, "--toy-width", "5"])
    assert r.exit_code == 0 and "toy_width: 5" in r.output, r.output
    r = CliRunner().invoke(app, [*base, "--toy-width", "0"])
    assert r.exit_code == 2 and "--toy-width" in r.output, r.output
    f = tmp_path / "run.yaml"
    f.write_text("toy_size: 7\n")  # its other config key
    r = CliRunner().invoke(app, [*base, "--config", str(f)])
    assert r.exit_code == 0 and "toy_width: 7" in r.output, r.output
    r = CliRunner().invoke(app, ["train", "--model", "/m", "--out", str(tmp_path / "r"), "--dump-config"])
    assert r.exit_code == 0 and "toy_width" not in r.output, r.output  # eagle3's settings only


def test_two_drafts_giving_one_setting_two_types_are_refused(monkeypatch):
    """One flag and one key per setting name: a draft that declared mask_token_id as a string
    beside the parallel drafts' integer would make both ambiguous (planted)."""

    @dataclasses.dataclass(frozen=True)
    class BadOptions(DraftOptions):
        mask_token_id: str = option("x", help="a mask token by name")

    class Bad(D.get("eagle3")):
        Options = BadOptions

    monkeypatch.setitem(D.REGISTRY, "bad", "tests.unit.trainer_client.test_draft_plugin:_Bad")
    monkeypatch.setitem(globals(), "_Bad", Bad)
    with pytest.raises(D.DraftConfigError, match=r"draft setting 'mask_token_id' has different types in bad .*dflash"):
        D.option_table()
