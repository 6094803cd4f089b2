"""A draft users can serve: ``OUT/final``, ``OUT/latest`` and the ``vllm serve`` line.

Checkpoints rotate (``keep_checkpoints``); the folder a user was told to serve must survive that,
and be what vLLM loads as an Eagle-3 draft: the checkpoint's ``draft/`` (speculators' format).
"""

from __future__ import annotations

import json
import os
import random
import shlex

import torch

from connector import protocol as P
from hsstream.tiny_model import hf_hidden_states
from tests.unit.trainer_client.test_trainer_loop import ListStream
from trainer_client.eagle3 import Eagle3OnlineTrainer, TrainConfig
from trainer_client.train import checkpoints as M
from trainer_client.stream import Sample

LAYERS = [2, 6, 9, 12]


class FakeDraft:
    """What save_checkpoint needs of a model: save_pretrained writing a config and weights."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def save_pretrained(self, d) -> None:  # noqa: ANN001
        os.makedirs(d, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"tag": self.tag}))
        (d / "model.safetensors").write_bytes(self.tag.encode())


def test_latest_follows_each_save_and_final_survives_rotation(tmp_path):
    for step in (2, 4, 6):
        ck = M.save_checkpoint(tmp_path, step, FakeDraft(f"s{step}"), {"step": step}, keep=1)
        latest = tmp_path / M.LATEST_LINK
        assert latest.is_symlink() and not os.path.isabs(os.readlink(latest))  # relative: the dir can move
        assert latest.resolve() == (ck / M.DRAFT_DIR).resolve()
        assert json.loads((latest / "config.json").read_text())["tag"] == f"s{step}"
        if step == 4:
            final = M.publish_final(tmp_path, ck)
    assert [s for s, _ in M.list_checkpoints(tmp_path)] == [6]  # step 4 rotated away ...
    assert json.loads((final / "config.json").read_text())["tag"] == "s4"  # ... its final copy stays
    assert (final / "model.safetensors").read_bytes() == b"s4"
    final = M.publish_final(tmp_path, M.latest_checkpoint(tmp_path))  # replaced, in place
    assert json.loads((final / "config.json").read_text())["tag"] == "s6"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "final", "latest"]  # no temporaries left


def test_serve_command_is_the_speculative_config_bench_acceptance_uses(tmp_path):
    line = M.serve_command("/models/my verifier", tmp_path / "final", 3)
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "serve", "/models/my verifier"] and argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {"method": "eagle3", "model": str((tmp_path / "final").resolve()),
                                   "num_speculative_tokens": 3}  # fmt: skip


def test_training_ends_with_a_final_draft_in_speculators_format_and_the_line_to_serve_it(tiny_model, tmp_path):
    rng = random.Random(0)
    samples = []
    for i in range(10):
        ids = [rng.randrange(0, 64) for _ in range(rng.randint(20, 30))]
        hs = hf_hidden_states(tiny_model, ids, LAYERS).to(torch.bfloat16)
        samples.append(Sample(P.SampleKey(job="unit", index=i), torch.tensor(ids), hs, LAYERS, 12, None))
    cfg = TrainConfig(verifier=tiny_model, out_dir=str(tmp_path), draft_vocab_size=128, checkpoint_every=3,
                      keep_checkpoints=1, progress=False, tensorboard=False, warmup_steps=1, threads=1,
                      draft_options={"ttt_steps": 2})  # fmt: skip
    r = Eagle3OnlineTrainer(cfg, {t: 1 for t in range(64)}).train(ListStream(samples))
    final = tmp_path / M.FINAL_DIR
    assert r.final_dir == str(final) and r.steps == 10
    last = M.latest_checkpoint(tmp_path)
    assert last.name == "step-00000010" and len(M.list_checkpoints(tmp_path)) == 1
    assert (tmp_path / M.LATEST_LINK).resolve() == (last / M.DRAFT_DIR).resolve()
    drafted = {p.name for p in (last / M.DRAFT_DIR).iterdir()}
    assert drafted <= {p.name for p in final.iterdir()} and "config.json" in drafted
    for name in drafted:
        assert (final / name).read_bytes() == (last / M.DRAFT_DIR / name).read_bytes()
    conf = json.loads((final / "config.json").read_text())
    assert conf["eagle_aux_hidden_state_layer_ids"] == LAYERS[:3]  # what vLLM's eagle3 loader reads
    spec = json.loads(shlex.split(r.serve)[4])
    assert shlex.split(r.serve)[:3] == ["vllm", "serve", tiny_model]
    assert spec == {"method": "eagle3", "model": str(final.resolve()), "num_speculative_tokens": 2}
    assert r.summary()["serve"] == r.serve
