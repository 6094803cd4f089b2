"""Token counts → draft vocabulary maps, as speculators and vLLM read them."""

from __future__ import annotations

import json

import pytest
import torch

from trainer_client.train import vocab as V


def test_counts_only_loss_carrying_tokens():
    c = V.count_tokens([[1, 2, 2, 3], [3, 3]], [[0, 1, 1, 1], None])
    assert c == {2: 2, 3: 3}
    with pytest.raises(ValueError, match="2 entries for 3 tokens"):
        V.count_tokens([[1, 2, 3]], [[1, 1]])


def test_maps_select_most_frequent_and_offsets_point_at_them():
    counts = {7: 50, 3: 40, 9: 40, 1: 5, 0: 1}
    d2t, t2d = V.build_vocab_maps(counts, draft_vocab_size=3, verifier_vocab_size=12)
    assert t2d.dtype == torch.bool and t2d.shape == (12,) and int(t2d.sum()) == 3
    target_ids = (torch.arange(3) + d2t).tolist()
    assert target_ids == [3, 7, 9]  # ties broken by id, listed ascending
    assert t2d.nonzero().flatten().tolist() == target_ids
    assert V.coverage(counts, t2d) == pytest.approx(130 / 136)


def test_full_vocabulary_needs_no_maps_and_no_counts():
    assert V.build_vocab_maps(None, 512, 512) == (None, None)
    assert V.build_vocab_maps({1: 1}, 32000, 512) == (None, None)


def test_reduced_vocabulary_without_counts_says_where_to_get_them():
    with pytest.raises(ValueError, match="needs token counts"):
        V.build_vocab_maps({}, 100, 512)
    with pytest.raises(ValueError, match="outside the verifier's vocabulary"):
        V.build_vocab_maps({600: 3}, 100, 512)


def test_counts_file_round_trip_and_formats(tmp_path):
    p = tmp_path / "c.json"
    V.save_token_counts({5: 2, 1: 9}, p)
    assert V.token_counts_from_file(p) == {1: 9, 5: 2}
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"4": 1}))
    assert V.token_counts_from_file(plain) == {4: 1}
    pt = tmp_path / "c.pt"
    torch.save({3: 4}, pt)
    assert V.token_counts_from_file(pt) == {3: 4}
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="non-empty mapping"):
        V.token_counts_from_file(bad)


def test_local_tokenisation_matches_the_sidecars(tiny_model):
    from connector.contract.rest import JobOptions, SampleIn
    from server.tokenization import Tokenizer

    samples = [
        {"prompt": "the model reads a prompt"},
        {"token_ids": [5, 6, 7]},
        {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello back"}]},
    ]
    ours = V.tokenize_samples(tiny_model, samples, "assistant")
    tok = Tokenizer(tiny_model)
    theirs = [tok(SampleIn(**s), JobOptions(loss_mask="assistant")) for s in samples]
    assert ours == [(t.token_ids, t.loss_mask) for t in theirs]
    assert sum(ours[2][1]) > 0 and sum(ours[2][1]) < len(ours[2][1])


def test_local_tokenisation_of_dataset_rows_with_the_jobs_template_matches_the_sidecars(tiny_model):
    """Rows as datasets ship them (extra keys, content parts, tool calls) and a job's own
    template and kwargs: the trainer's local counts see the sidecar's ids and masks."""
    from connector.contract.rest import JobOptions, SampleIn
    from server.tokenization import Tokenizer
    from tests.unit.server.test_sidecar_data_rows import PARTS, TOOL_CHAT, TOOLS, TOOLS_TEMPLATE

    samples = [
        {"model": "gpt-4", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"messages": PARTS},
        {"messages": TOOL_CHAT, "tools": TOOLS},
    ]
    job = {"chat_template": TOOLS_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}}
    ours = V.tokenize_samples(tiny_model, samples, "assistant", **job)
    opt = JobOptions(loss_mask="assistant", **job)
    theirs = [Tokenizer(tiny_model)(SampleIn(**s), opt) for s in samples]
    assert ours == [(t.token_ids, t.loss_mask) for t in theirs] and len(ours) == 3
    assert V.token_counts_from_samples(tiny_model, samples, "assistant", **job)
