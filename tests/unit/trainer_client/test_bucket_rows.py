"""Rows padded to a few lengths on CUDA (``Draft.device_row``): speculators compiles each draft's
forward there, and a row of every length was a recompile (an H100 run trained 1.3 samples/s).
Padding must leave what a step learns exactly as it was: the same loss and the same per-position
counts on the same sample, checked here on CPU with each draft's real forward on the tiny verifier.
DFlash and DSpark draw their blocks over the whole row, so a padded row changes what they count:
they are left unpadded, and this test says so (it sees their counts move when padded)."""

from __future__ import annotations

import random

import pytest
import torch

from connector import protocol as P
from hsstream.tiny_model import hf_hidden_states
from tests.unit.trainer_client.test_drafts import LAYERS, cfg
from tests.unit.trainer_client.test_trainer_loop import counts_of
from trainer_client.drafts.base import bucket_length, pad_to_bucket
from trainer_client.stream import Sample
from trainer_client.train.trainer import OnlineTrainer


@pytest.fixture(scope="module")
def sample(tiny_model) -> Sample:
    rng = random.Random(0)
    ids = [rng.randrange(0, 64) for _ in range(37)]
    hs = hf_hidden_states(tiny_model, ids, LAYERS).to(torch.bfloat16)
    return Sample(P.SampleKey(job="unit", index=0), torch.tensor(ids), hs, LAYERS, 12, None)


def test_bucket_lengths_are_few_and_never_shorter():
    assert [bucket_length(n) for n in (1, 2, 128, 129, 300, 512, 513, 4096)] == [128, 128, 128, 256, 512, 512, 1024, 4096]
    assert len({bucket_length(n) for n in range(1, 4097)}) == 6


def test_padding_is_what_speculators_collate_pads_with():
    row = {"input_ids": torch.ones(1, 3, dtype=torch.long), "document_ids": torch.zeros(1, 3, dtype=torch.long),
           "hidden_states": torch.ones(1, 3, 2), "loss_mask": torch.ones(1, 3, dtype=torch.long)}  # fmt: skip
    out = pad_to_bucket(row)
    assert all(t.shape[1] == 128 for t in out.values()) and out["hidden_states"].shape == (1, 128, 2)
    assert out["document_ids"][0, 3:].eq(-1).all() and out["loss_mask"][0, 3:].eq(0).all()
    assert out["input_ids"][0, 3:].eq(0).all() and out["hidden_states"][0, 3:].eq(0).all()
    assert torch.equal(out["input_ids"][0, :3], row["input_ids"][0])


@pytest.mark.parametrize("draft", ["eagle3", "peagle", "dflash", "dspark"])
def test_a_padded_row_trains_as_the_row_itself(tiny_model, sample, tmp_path, draft):
    tr = OnlineTrainer(cfg(tiny_model, tmp_path / draft, draft=draft), counts_of([sample]))
    tr.prepare()
    row = tr.draft.pack([tr.draft.features(sample, tr.aux_layer_ids)])
    got = []
    for r in (row, pad_to_bucket(row), tr.draft.device_row(row)):
        r = {k: v.to(tr.device) if torch.is_tensor(v) else v for k, v in r.items()}  # the model's device: cuda on a GPU host
        torch.manual_seed(0)  # P-EAGLE draws its anchors from the global generator
        with torch.no_grad():
            loss, correct, counted = tr.draft.forward(tr.model, r)
        got.append((float(loss), [float(c) for c in correct], [float(n) for n in counted]))
    plain, padded, used = got
    if tr.draft.bucket_rows:
        assert padded[1:] == plain[1:] and padded[0] == pytest.approx(plain[0], rel=1e-4), (plain, padded)
    else:
        assert padded[2] != plain[2], "padding no longer moves its counts: it could be padded too"
        # so it is not padded: the same counts (padding moves them, above); the loss to float rounding, as CUDA's
        # kernels do not sum in a fixed order (an H100 saw 0.04052942991 against 0.04052942246)
        assert used[1:] == plain[1:] and used[0] == pytest.approx(plain[0], rel=1e-5), (plain, used)
