"""The live loop's trainer side: a warm start from the serving draft, ``--follow``'s set-up, and the
``--mix`` share of the original data (against a stand-in sidecar: the share is logic)."""

from __future__ import annotations

import json

import pytest
import torch

from trainer_client.train.config import TrainConfig
from trainer_client.train.mixing import Mixer, mix_target
from trainer_client.train.run import follow_setup


@pytest.fixture(scope="module")
def init_draft(tiny_model, tmp_path_factory):
    """A draft with its own layers, a 100-token vocabulary and its maps: what a serving draft is."""
    from trainer_client.drafts import eagle3 as E3

    d2t = torch.arange(100, dtype=torch.long) * 2 - torch.arange(100)  # target id = index + d2t[index]: 0, 2, 4...
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[torch.arange(100) * 2] = True
    m = E3.build_draft(tiny_model, [1, 5, 8], draft_vocab_size=100, t2d=t2d, d2t=d2t, seed=7)
    with torch.no_grad():
        m.fc.weight.add_(0.5)  # weights no fresh build has
    d = tmp_path_factory.mktemp("init") / "draft"
    m.save_pretrained(d)
    return d, m


def test_a_warm_start_takes_the_drafts_weights_layers_and_vocabulary(tiny_model, init_draft, tmp_path):
    from trainer_client.train.trainer import OnlineTrainer

    d, m = init_draft
    cfg = TrainConfig(verifier=tiny_model, out_dir=str(tmp_path / "run"), init_draft=str(d), progress=False,
                      logger="none", aux_layer_ids=[2, 6, 9])  # fmt: skip
    t = OnlineTrainer(cfg, token_counts=None)
    t.prepare()
    assert t.aux_layer_ids == [1, 5, 8] and t.draft_vocab_size == 100  # the draft's, not the flags'
    got, want = t.model.state_dict(), m.state_dict()
    for k in ("fc.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight", "d2t", "t2d"):
        assert torch.equal(got[k].cpu(), want[k]), k
    maps = torch.load(tmp_path / "run" / "vocab_maps.pt", weights_only=True)
    assert torch.equal(maps["d2t"], want["d2t"])  # a resume keeps the same maps


def test_a_warm_start_refuses_another_kind_of_draft_and_a_non_draft(tiny_model, init_draft, tmp_path):
    from trainer_client.train.trainer import OnlineTrainer
    from trainer_client.train.warm_start import InitDraftError

    d, _ = init_draft
    cfg = TrainConfig(verifier=tiny_model, out_dir=str(tmp_path / "a"), init_draft=str(d), draft="dflash",
                      draft_options={"mask_token_id": 1}, progress=False, logger="none")  # fmt: skip
    with pytest.raises(ValueError, match="eagle3 draft, not dflash"):
        OnlineTrainer(cfg, token_counts=None).prepare()
    cfg = TrainConfig(verifier=tiny_model, out_dir=str(tmp_path / "b"), init_draft=str(tmp_path), progress=False,
                      logger="none")  # fmt: skip
    with pytest.raises(InitDraftError, match="not a draft directory"):
        OnlineTrainer(cfg, token_counts=None).prepare()


def test_follow_has_no_total_so_its_lr_stays_constant(tmp_path):
    cfg = TrainConfig(verifier="v", out_dir=str(tmp_path), schedule="cosine")
    assert follow_setup(cfg, jobs=None, submit_file=None, token_counts_file=None) is None
    assert cfg.schedule == "constant"
    assert json.loads((tmp_path / "jobs.json").read_text()) == {"jobs": None, "follow": True}
    with pytest.raises(ValueError, match="not with --job or --submit"):
        follow_setup(cfg, jobs=["j"], submit_file=None, token_counts_file=None)
    capped = TrainConfig(verifier="v", out_dir=str(tmp_path / "c"), schedule="cosine", schedule_steps=100)
    follow_setup(capped, jobs=None, submit_file=None, token_counts_file=None)
    assert capped.schedule == "cosine"  # a horizon given: kept


class FakeSidecar:
    def __init__(self) -> None:
        self.jobs_: dict[str, int] = {"old": 1000}  # there before the run: neither traffic nor mix
        self.uploads: list[list[dict]] = []

    def jobs(self):  # noqa: ANN201
        return [type("J", (), {"job_id": j, "counts": {"queued": n}})() for j, n in self.jobs_.items()]

    def upload(self, rows, options, filename=""):  # noqa: ANN001, ANN201
        rows = list(rows)
        self.uploads.append(rows)
        jid = f"mix{len(self.uploads)}"
        self.jobs_[jid] = len(rows)
        return type("C", (), {"job_id": jid, "num_samples": len(rows)})()


def test_the_mix_keeps_its_share_of_the_traffic(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(10)]
    sc = FakeSidecar()
    m = Mixer(lambda: sc, lambda n: iter(rows), 0.25, tmp_path, batch=4)
    assert m.look(sc) == 0  # no traffic yet: nothing mixed in
    sc.jobs_["t1"] = 30  # traffic arrives
    sent = m.look(sc)
    assert sent == 8 and mix_target(30, 0.25) == 10  # whole batches up to the target
    sc.jobs_["t2"] = 30
    m.look(sc)
    mixed = sum(len(u) for u in sc.uploads)
    assert mixed == 20 and abs(mixed / (mixed + 60) - 0.25) < 0.01
    assert [r["id"] for r in sc.uploads[2]] == ["r8", "r9", "r0", "r1"]  # a second pass through the file
    rec = json.loads((tmp_path / "mix_jobs.json").read_text())
    assert set(rec["mine"]) == {"mix1", "mix2", "mix3", "mix4", "mix5"} and rec["before"] == ["old"]
    empty = Mixer(lambda: None, lambda n: iter([]), 0.5, tmp_path / "x", batch=2)
    empty.before = set()  # everything the sidecar holds is traffic
    busy = FakeSidecar()
    busy.jobs_ = {"t": 50}
    with pytest.raises(ValueError, match="no rows"):
        empty.look(busy)


def test_a_share_out_of_range_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mix-share"):
        Mixer(lambda: None, lambda n: iter([]), 1.0, tmp_path)
