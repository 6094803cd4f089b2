"""hsstream/evaluate.py without an engine: our per-request figures against vLLM's own counting
(``SpecDecodingStats.observe_draft``, what its ``vllm:spec_decode_*`` counters add up), the
agreement check, the draft-dir check and the prompts file. The real engine:
tests/integration/hsstream/test_eval.py."""

from __future__ import annotations

import json
import random

import pytest

from hsstream import evaluate as E


def records(seed: int, k: int, n: int = 20) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        drafted = [rng.choice([k, k, k, 0, 1]) for _ in range(rng.randint(1, 30))]
        out.append({"per_step_drafted": drafted, "per_step_accepted": [rng.randint(0, d) for d in drafted]})
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_per_request_figures_count_as_vllms_stats(k):
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    recs = records(k, k)
    st = SpecDecodingStats.new(k)
    for r in recs:
        for a, d in zip(r["per_step_accepted"], r["per_step_drafted"]):
            if d:  # the scheduler makes stats only for steps that drafted (make_spec_decoding_stats)
                st.observe_draft(num_draft_tokens=d, num_accepted_tokens=a)
    ours = E.per_request_figures(recs + [None], k)
    assert ours == {"drafts": st.num_drafts, "drafted": st.num_draft_tokens, "accepted": st.num_accepted_tokens,
                    "accepted_per_position": st.num_accepted_tokens_per_pos}  # fmt: skip
    s = E.summarise(st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.num_accepted_tokens_per_pos)
    assert s["mean_acceptance_length"] == pytest.approx(1 + st.num_accepted_tokens / st.num_drafts)


def _res(ours: dict, vm: dict) -> dict:
    return {"temperatures": {"0.0": {"ours": ours, "vllm_metrics": vm}}}


def test_agreement_sees_swapped_positions_and_a_missing_side():
    f = E.per_request_figures(records(0, 3), 3)
    a = {**f, **E.summarise(f["drafts"], f["drafted"], f["accepted"], f["accepted_per_position"])}
    assert E.agreement(_res(a, dict(a))) == 0.0
    p = a["acceptance_per_position"]
    swapped = {**a, "acceptance_per_position": [p[2], p[1], p[0]]}
    assert E.agreement(_res(swapped, a)) == pytest.approx(p[0] - p[2]) and p[0] - p[2] > 0.02
    assert E.agreement(_res({**a, "acceptance_per_position": None}, a)) == float("inf")


def test_check_draft_dir_names_what_is_missing(tmp_path):
    with pytest.raises(E.DraftError, match="no such directory"):
        E.check_draft_dir(tmp_path / "nope")
    (tmp_path / "final").mkdir()
    with pytest.raises(E.DraftError, match="its draft is in final/"):
        E.check_draft_dir(tmp_path)
    d = tmp_path / "final"
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(E.DraftError, match="not an Eagle-3 draft"):
        E.check_draft_dir(d)
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    with pytest.raises(E.DraftError, match="no weights"):
        E.check_draft_dir(d)
    (d / "model.safetensors").write_bytes(b"")
    assert E.check_draft_dir(d) == d.resolve()


def test_read_prompts_jsonl_or_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n\nplain line\n')
    assert E.read_prompts(f) == ["a b", "plain line"]
    f.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="no string 'prompt'"):
        E.read_prompts(f)
