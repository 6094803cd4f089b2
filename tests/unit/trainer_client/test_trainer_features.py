"""What the Eagle-3 trainer checks and builds from a sample, before any model is loaded."""

from __future__ import annotations

import pytest
import torch

from connector import protocol as P
from trainer_client.drafts.eagle3 import MissingLayersError, eagle3_layers, features, pack, swap_aux
from trainer_client.stream import Sample

N, H = 12, 4


def sample(layer_ids, t=5, index=0, mask=None):
    # hidden state value = layer id * 16 + position (exact in bf16): every slice is identifiable
    hs = torch.tensor([[[lid * 16 + pos] * H for lid in layer_ids] for pos in range(t)], dtype=torch.float32)
    ids = torch.arange(100, 100 + t)
    m = torch.tensor(mask, dtype=torch.bool) if mask is not None else None
    return Sample(P.SampleKey(job="j", index=index), ids, hs.to(torch.bfloat16), list(layer_ids), N, m)


def test_missing_layer_n_is_a_clear_error():
    with pytest.raises(MissingLayersError, match=r"not layer N=12 .*targets.*\[2, 6, 9, 12\]"):
        eagle3_layers(sample([2, 6, 9]))


def test_missing_aux_layers_are_named():
    with pytest.raises(MissingLayersError, match=r"exactly three aux layers below N=12; the stream carries \[2, 6\]"):
        eagle3_layers(sample([2, 6, 12]))
    with pytest.raises(MissingLayersError, match=r"not aux layer\(s\) \[1\]"):
        eagle3_layers(sample([2, 6, 9, 12]), [1, 6, 9])
    with pytest.raises(MissingLayersError, match="exactly three aux layers, 2 requested"):
        eagle3_layers(sample([2, 6, 9, 12]), [6, 9])


def test_stream_and_verifier_must_agree():
    with pytest.raises(MissingLayersError, match="verifier with 12 layers.*has 24"):
        eagle3_layers(sample([2, 6, 9, 12]), num_hidden_layers=24)


def test_aux_layers_are_ascending_whatever_the_stream_order():
    # vLLM hands the draft its aux states in ascending layer order, so training must too
    s = sample([9, 12, 2, 6])
    assert eagle3_layers(s) == [2, 6, 9]
    f = features(s, [2, 6, 9])
    assert f.aux.shape == (5, 3 * H) and f.aux.dtype == torch.float32
    assert f.aux[3].tolist() == [35.0] * H + [99.0] * H + [147.0] * H
    assert f.last[:, 0].tolist() == [192.0 + p for p in range(5)]
    assert f.loss_mask.all()


def test_pack_shifts_like_speculators_and_separates_documents():
    a = features(sample([2, 6, 9, 12], t=4, mask=[1, 0, 1, 1]), [2, 6, 9])
    b = features(sample([2, 6, 9, 12], t=3, index=1), [2, 6, 9])
    p = pack([a, b])
    # the draft at position t sees aux[t] and token t+1 and predicts the verifier at t+1
    assert p["input_ids"].tolist() == [[101, 102, 103, 101, 102]]
    assert p["hidden_states"][0, :, 0].tolist() == [32, 33, 34, 32, 33]
    assert p["verifier_last_hidden_states"][0, :, 0].tolist() == [193, 194, 195, 193, 194]
    assert p["loss_mask"].tolist() == [[False, True, True, True, True]]
    assert p["document_ids"].tolist() == [[0, 0, 0, 1, 1]]
    assert p["position_ids"].tolist() == [[1, 2, 3, 1, 2]]


def test_swap_aux_keeps_tokens_and_targets_but_not_inputs():
    a = features(sample([2, 6, 9, 12], t=5), [2, 6, 9])
    other = sample([2, 6, 9, 12], t=4, index=1)
    other.hidden_states += 7  # a different sample's states
    b = features(other, [2, 6, 9])
    s = swap_aux(a, b)
    assert s.key == a.key and s.num_tokens == 4
    assert torch.equal(s.input_ids, a.input_ids[:4]) and torch.equal(s.last, a.last[:4])
    assert torch.equal(s.aux, b.aux) and not torch.equal(s.aux, a.aux[:4])


def test_pack_equals_speculators_shift_batch_and_collate_on_the_same_samples():
    # issue 12 item 3: ours against speculators' own shift_batch + CollateFn, not hand-written values
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    items = [
        features(sample([2, 6, 9, 12], t=t, index=i, mask=[(i + p) % 3 != 0 for p in range(t)]), [2, 6, 9])
        for i, t in enumerate((7, 4, 9))
    ]
    ours = pack(items)
    raw = [
        {"input_ids": f.input_ids, "hidden_states": f.aux, "verifier_last_hidden_states": f.last,
         "loss_mask": f.loss_mask, "lengths": torch.tensor([f.num_tokens]),
         "position_ids": torch.arange(f.num_tokens)}  # fmt: skip
        for f in items
    ]
    total = sum(f.num_tokens - 1 for f in items)
    theirs = CollateFn(max_len=total, hidden_size=H, dtype=torch.float32, preprocess=shift_batch)(raw)
    for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids",
              "document_ids"):  # fmt: skip
        assert ours[k].dtype == theirs[k].dtype, k
        assert torch.equal(ours[k], theirs[k]), k
