"""Assistant masks for any chat template, and token ids as vLLM computes them
(connector/contract/sample_tokens.py), on templates in the styles users bring (tests/unit/connector/chat_templates.py)."""

from __future__ import annotations

import pytest

from connector.contract.sample_tokens import SampleRefused, _marked_mask, assistant_mask, encode_sample, turn_by_turn_mask
from tests.unit.connector.chat_templates import GEMMA, LLAMA2, LLAMA3, MISTRAL, MISTRAL_SYSTEM_LAST, QWEN3, STYLES, make_tokenizer

UNICODE = "Emoji 🚀🎉👍🏽, 中文：你好，世界！ 日本語のテキスト, עברית: שלום עולם, العربية: مرحبا بالعالم"

CONVERSATIONS = {
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
    ],
    "two-assistant-turns": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sea."},
        {"role": "user", "content": "And another one?"},
        {"role": "assistant", "content": "Green.\nA second line, too."},
    ],
    "empty-assistant-turn": [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
    ],
    "unicode": [
        {"role": "system", "content": "Réponds en 日本語 ✓"},
        {"role": "user", "content": "שלום! 你好? 👋"},
        {"role": "assistant", "content": UNICODE},
        {"role": "user", "content": "مرة أخرى"},
        {"role": "assistant", "content": "再见 👋 وداعا"},
    ],
}


@pytest.fixture(scope="module")
def tokenizers(tiny_model):
    return {(st.name, marked): make_tokenizer(tiny_model, st, marked=marked) for st in STYLES for marked in (False, True)}


def masked_spans(tok, ids, mask):
    """The decoded text of each run of masked tokens."""
    spans, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return [tok.decode(s, skip_special_tokens=False) for s in spans]


def expected_spans(style, msgs):
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return [(style.last_turn_prefix if i == last else "") + style.expect(m["content"])
            for i, m in enumerate(msgs) if m["role"] == "assistant"]  # fmt: skip


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("style", STYLES, ids=[s.name for s in STYLES])
def test_mask_is_exactly_the_assistant_text_and_its_end_of_turn(tokenizers, style, conv):
    tok = tokenizers[(style.name, False)]
    msgs = CONVERSATIONS[conv]
    ids, mask = encode_sample(tok, {"messages": msgs})
    # the ids are the template's render encoded as vLLM does for chat (no second BOS)
    assert ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    assert masked_spans(tok, ids, mask) == expected_spans(style, msgs)


@pytest.mark.parametrize("style", STYLES, ids=[s.name for s in STYLES])
def test_sharegpt_roles_give_the_same_ids_and_mask(tokenizers, style):
    tok = tokenizers[(style.name, False)]
    msgs = CONVERSATIONS["two-assistant-turns"]
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    conv = [{"from": speaker[m["role"]], "value": m["content"]} for m in msgs]
    assert encode_sample(tok, {"conversations": conv}) == encode_sample(tok, {"messages": msgs})


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("style", STYLES, ids=[s.name for s in STYLES])
def test_marker_free_mask_equals_the_marked_templates_mask(tokenizers, style, conv):
    msgs = CONVERSATIONS[conv]
    marked = tokenizers[(style.name, True)]
    by_markers = _marked_mask(marked, msgs)
    assert any(by_markers[1])
    assert turn_by_turn_mask(marked, msgs) == by_markers  # both methods, one template
    assert turn_by_turn_mask(tokenizers[(style.name, False)], msgs) == by_markers  # markers stripped
    assert assistant_mask(marked, msgs) == by_markers  # a marked template uses its markers


def test_tiny_models_own_marked_template(tiny_model):
    from connector.contract.sample_tokens import load_tokenizer

    tok = load_tokenizer(tiny_model)
    for msgs in CONVERSATIONS.values():
        out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert any(out["assistant_masks"])
        assert turn_by_turn_mask(tok, msgs) == (out["input_ids"], out["assistant_masks"])


def test_qwen3_style_turn_that_renders_differently_later_still_gets_its_mask(tokenizers):
    """An earlier turn loses its <think> block once a later user turn exists: the render up to
    it is no prefix of the whole, and the turn is found by its end-of-turn token instead."""
    tok = tokenizers[(QWEN3.name, False)]
    msgs = [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "hmm, easy"},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "still easy"},
    ]
    full = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    upto = tok.apply_chat_template(msgs[:2], tokenize=True, return_dict=True)["input_ids"]
    assert full[: len(upto)] != upto  # the case this test is about
    ids, mask = encode_sample(tok, {"messages": msgs})
    assert masked_spans(tok, ids, mask) == ["Done.<|im_end|>", "<think>\nstill easy\n</think>\n\nYes.<|im_end|>"]


def test_template_that_moves_the_system_prompt_masks_each_turn_by_its_own_tokens(tiny_model):
    """The prompt of an earlier turn (system prompt in its user turn) is no prefix of the whole
    render (system prompt in the last user turn): the turn is found by its own tokens, which
    occur once after the previous turn; the render spelled out by hand."""
    from tests.unit.server.test_sidecar_data_rows import spelled

    tok = make_tokenizer(tiny_model, MISTRAL_SYSTEM_LAST)
    msgs = [{"role": "system", "content": "Be kind."}, *CONVERSATIONS["two-assistant-turns"]]
    want = spelled(tok, ("<s>[INST] Name a colour.[/INST]", 0), (" Blue, like the sea.</s>", 1),
                   ("[INST] Be kind.\n\nAnd another one?[/INST]", 0), (" Green.\nA second line, too.</s>", 1))  # fmt: skip
    assert encode_sample(tok, {"messages": msgs}) == want
    # one exchange: the prompt is a prefix
    ids, mask = encode_sample(tok, {"messages": msgs[:3]})
    assert masked_spans(tok, ids, mask) == [" Blue, like the sea.</s>"]


def test_a_moved_turn_whose_tokens_occur_twice_is_refused(tiny_model):
    tok = make_tokenizer(tiny_model, MISTRAL_SYSTEM_LAST)
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "Yes."}]  # fmt: skip
    with pytest.raises(SampleRefused, match=r"message 2 \(assistant\): the chat template renders the conversation "
                                            r"before this turn differently once later turns follow, and the turn's "
                                            r"own tokens occur 2 times"):  # fmt: skip
        encode_sample(tok, {"messages": msgs})


@pytest.mark.parametrize("style", STYLES, ids=[s.name for s in STYLES])
def test_conversation_without_assistant_tokens_is_refused(tokenizers, style):
    tok = tokenizers[(style.name, False)]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello?"}]
    with pytest.raises(SampleRefused, match=r"no assistant tokens to train on \(roles in the conversation: system, user\)"):
        encode_sample(tok, {"messages": msgs})
    ids, mask = encode_sample(tok, {"messages": msgs}, loss_mask="all")  # every token carries loss: fine
    assert ids and all(mask)


def test_template_errors_and_unknown_speakers_are_refused_with_the_reason(tokenizers):
    tok = tokenizers[(MISTRAL.name, False)]
    with pytest.raises(SampleRefused, match="the chat template refused the conversation: Conversation roles must alternate"):
        encode_sample(tok, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    with pytest.raises(SampleRefused, match="unknown ShareGPT speaker 'bot'"):
        encode_sample(tok, {"conversations": [{"from": "bot", "value": "x"}]})


def test_bos_on_prompts_once_on_chats(tokenizers, tiny_model):
    from connector.contract.sample_tokens import load_tokenizer

    tok = tokenizers[(LLAMA3.name, False)]
    bos = tok.bos_token_id
    text = "The quick brown fox 🦊"
    ids, _ = encode_sample(tok, {"prompt": text})
    assert ids == [bos, *tok.encode(text, add_special_tokens=False)]  # the BOS the model was trained with
    ids, _ = encode_sample(tok, {"messages": CONVERSATIONS["system"]})
    assert ids[0] == bos and ids.count(bos) == 1  # the template writes it; nothing adds a second
    ids, _ = encode_sample(tok, {"messages": CONVERSATIONS["system"]}, mode="regenerate")
    assert ids[0] == bos and ids.count(bos) == 1
    qwen = load_tokenizer(tiny_model)  # no BOS: nothing is prepended
    assert encode_sample(qwen, {"prompt": text})[0] == qwen.encode(text, add_special_tokens=False)


def test_regenerate_prompts_with_the_generation_prompt_and_trains_nothing(tokenizers):
    tok = tokenizers[(LLAMA3.name, False)]
    msgs = CONVERSATIONS["two-assistant-turns"]
    ids, mask = encode_sample(tok, {"messages": msgs}, mode="regenerate")
    assert ids == tok.apply_chat_template(msgs[:3], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert not any(mask)


#: The "system" conversation as each folding template must render it, written out by hand from
#: the real templates (Mistral's [INST], Gemma's turns, Llama-2's <<SYS>>): (no-loss prompt,
#: the assistant's tokens that carry loss, what follows them). The system prompt joins the
#: first user turn followed by "\n\n"; nothing else of it is left.
FOLDED = {
    MISTRAL.name: ("<s>[INST] You are terse.\n\nWhat is two plus two? [/INST]", "Four.</s>", ""),
    GEMMA.name: ("<bos><start_of_turn>user\nYou are terse.\n\nWhat is two plus two?<end_of_turn>\n"
                 "<start_of_turn>model\n", "Four.<end_of_turn>", "\n"),  # fmt: skip
    LLAMA2.name: ("<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is two plus two? [/INST]", " Four. </s>", ""),
}


@pytest.mark.parametrize("style", [MISTRAL, GEMMA, LLAMA2], ids=lambda s: s.name)
def test_system_prompt_folded_into_the_first_user_turn_with_a_blank_line(tokenizers, style):
    """The ids and mask of a conversation whose system prompt the template folds into the first
    user turn, against the text spelled out here (not the template's own render): a template or
    tokenisation that drops the "\\n\\n", keeps a system turn, or masks the system prompt fails."""
    tok = tokenizers[(style.name, False)]
    prompt, answer, tail = FOLDED[style.name]

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    want = enc(prompt + answer + tail)
    p, pa = enc(prompt), enc(prompt + answer)
    assert want[: len(p)] == p and want[: len(pa)] == pa  # the spelled split falls on token boundaries
    ids, mask = encode_sample(tok, {"messages": CONVERSATIONS["system"]})
    assert ids == want
    assert mask == [0] * len(p) + [1] * (len(pa) - len(p)) + [0] * (len(want) - len(pa))
