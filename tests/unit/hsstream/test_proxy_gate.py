"""The swap's gate: held-out requests as the prompts vLLM saw, the pass rule, version names.
(The measure itself is ``hsstream eval``'s, tested with vLLM in tests/integration/hsstream/test_eval.py.)"""

from __future__ import annotations

import pytest

from hsstream.proxy import gate as G


def test_held_out_requests_are_prompted_as_vllm_renders_them(tiny_model):
    from connector.contract.sample_tokens import load_tokenizer

    tok = load_tokenizer(tiny_model)
    held = [
        {"row": {"messages": [{"role": "user", "content": "Hello there"}]}, "options_key": ""},
        {"row": {"prompt": "The sky is"}, "options_key": ""},
        {"row": {"messages": "not a list"}, "options_key": ""},  # unusable: skipped, not fatal
    ]
    chat, plain = G.prompts_of(held, tiny_model, 1000)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                   tokenize=False)  # fmt: skip
    want = tok(text, add_special_tokens=False)["input_ids"]  # as vLLM's chat path encodes the render
    assert chat == want and tok.decode(chat).endswith("<|im_start|>assistant\n")
    assert plain == tok("The sky is", add_special_tokens=True)["input_ids"]
    assert len(G.prompts_of(held, tiny_model, 3)[0]) == 3  # cut to its last tokens


def test_the_new_draft_passes_only_when_at_least_as_good():
    assert G.passes({"new": 1.5, "live": 1.5})
    assert not G.passes({"new": 1.49, "live": 1.5})
    assert not G.passes({"new": 1.55, "live": 1.5}, margin=0.1)


def test_versions_name_the_run_and_step(tmp_path):
    d = tmp_path / "runA" / "checkpoints" / "step-120" / "draft"
    d.mkdir(parents=True)
    assert G.draft_version(d) == "runA-step120"
    f = tmp_path / "runB" / "final"
    f.mkdir(parents=True)
    (f / "model.safetensors").write_bytes(b"x")
    assert G.draft_version(f).startswith("runB-final-")


def test_the_gate_says_why_it_cannot_measure(tmp_path):
    with pytest.raises(ValueError, match="no held-out traffic"):
        G.measure(str(tmp_path), None, [], model="some-model")
