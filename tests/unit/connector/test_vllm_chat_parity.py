"""The ids the sidecar computes for dataset rows (content-part lists, tool calls, tools, template
kwargs, a job's own template) are the ids `vllm serve` computes for the same chat request: its
own renderer (``parse_chat_messages`` + ``safe_apply_chat_template``, what /v1/chat/completions
runs, after its request model renames ``reasoning_content``), called in-process on the tiny
verifier, no server."""

from __future__ import annotations

import copy

import pytest

from connector.contract.sample_tokens import encode_sample
from tests.unit.connector.chat_templates import CHATML, QWEN3, make_tokenizer
from tests.unit.server.test_sidecar_data_rows import (PARTS, PARTS_TEMPLATE, QWEN3_SWITCH, THINK_TEMPLATE, TOOL_CHAT, TOOLS,
                                               TOOLS_TEMPLATE, TWO_TURNS)  # fmt: skip

pytest.importorskip("vllm.renderers.hf")


@pytest.fixture(scope="module")
def model_config(tiny_model):
    from vllm.config import ModelConfig

    return ModelConfig(model=tiny_model, tokenizer=tiny_model, dtype="float32", max_model_len=512)


def vllm_ids(mc, tok, messages, *, tools=None, chat_template=None, kwargs=None, generation_prompt=False):
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    messages = copy.deepcopy(messages)
    for m in messages:  # ChatCompletionRequest._normalize_messages_before: the deprecated name renamed
        if (why := m.pop("reasoning_content", None)) is not None and m.get("reasoning") is None:
            m["reasoning"] = why
    fmt = resolve_chat_template_content_format(chat_template, tools, "auto", tok, model_config=mc)
    conv, _, _ = parse_chat_messages(messages, mc, content_format=fmt)
    text = safe_apply_chat_template(mc, tok, conv, tools=tools, chat_template=chat_template, tokenize=False,
                                    add_generation_prompt=generation_prompt, **(kwargs or {}))  # fmt: skip
    return tok(text, add_special_tokens=False)["input_ids"]  # vLLM's chat prompts add no special tokens


def tokenizers(tiny_model):
    from connector.contract.sample_tokens import load_tokenizer

    return {"tiny": load_tokenizer(tiny_model), "chatml": make_tokenizer(tiny_model, CHATML),
            "qwen3": make_tokenizer(tiny_model, QWEN3)}  # fmt: skip


CASES = [
    ("tiny", PARTS, None, None, None),
    ("chatml", PARTS, None, None, None),
    ("qwen3", PARTS, None, None, None),
    ("tiny", PARTS, None, PARTS_TEMPLATE, None),  # a template that loops over parts: "openai" format
    ("tiny", TOOL_CHAT, TOOLS, None, None),  # the tiny template ignores tools; null content, tool role
    ("chatml", TOOL_CHAT, TOOLS, TOOLS_TEMPLATE, None),
    ("tiny", TOOL_CHAT, TOOLS, TOOLS_TEMPLATE, {"enable_thinking": False}),
    ("tiny", [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": "Yo"}],
     None, THINK_TEMPLATE, {"enable_thinking": False}),
    ("chatml", [*TOOL_CHAT[:2], {**TOOL_CHAT[2], "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                TOOL_CHAT[3]], TOOLS, TOOLS_TEMPLATE, None),  # tool results as parts: joined even for "openai"
    ("qwen3", [{"role": "user", "content": "Think."}, {"role": "assistant", "content": "A.", "reasoning": "hm"},
               {"role": "user", "content": "More?"}, {"role": "assistant", "content": "B.", "reasoning_content": "ok"}],
     None, None, None),  # reasoning under either name
    ("qwen3", TWO_TURNS, None, QWEN3_SWITCH, {"enable_thinking": False}),
    ("chatml", [{"role": "developer", "content": "Be brief."}, *TWO_TURNS], None, None, None),  # developer → system
    ("chatml", [{"role": "system", "content": "Sys."}, TWO_TURNS[0], {"role": "developer", "content": "Dev."},
                *TWO_TURNS[1:]], None, None, None),  # merged into the first system message
    ("tiny", [{"role": "developer", "content": [{"type": "text", "text": "D1"}, {"type": "text", "text": "D2"}]},
              {"role": "system", "content": "S"}, *TWO_TURNS], None, PARTS_TEMPLATE, None),
    ("tiny", [{"role": "developer", "content": "D"}, *TWO_TURNS], None,
     "{%- for m in messages %}{{- m['role'] + ':' + m['content'] + '\\n' }}{%- endfor %}{# 'developer' known #}", None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "msgs", "tools", "template", "kwargs"), CASES)
@pytest.mark.parametrize("mode", ["extract", "regenerate"])
def test_ids_are_vllms_own_rendering(model_config, tiny_model, name, msgs, tools, template, kwargs, mode):
    tok = tokenizers(tiny_model)[name]
    sample = {"messages": copy.deepcopy(msgs), **({"tools": tools} if tools else {})}
    job = {k: v for k, v in (("chat_template", template), ("chat_template_kwargs", kwargs)) if v is not None}
    ids, _ = encode_sample(tok, sample, mode=mode, loss_mask="all" if mode == "extract" else "assistant", **job)
    want_msgs = msgs if mode == "extract" else msgs[: max(i for i, m in enumerate(msgs) if m["role"] != "assistant") + 1]
    want = vllm_ids(model_config, tok, want_msgs, tools=tools, chat_template=template, kwargs=kwargs,
                    generation_prompt=mode == "regenerate")  # fmt: skip
    assert ids == want


SHAREGPT_MESS = [  # as ShareGPT V3 ships them: assistant first, other assistants' names, blank and repeated turns
    {"from": "gpt", "value": "...the end of the last part."}, {"from": "human", "value": "Go on."},
    {"from": "chatgpt", "value": "First."}, {"from": "bing", "value": "Second."}, {"from": "human", "value": " "},
    {"from": "user", "value": "And?"}, {"from": "bard", "value": "Done."},
]  # fmt: skip
#: The rule of sample_tokens.sharegpt_messages, spelled out: the leading reply dropped, the blank
#: turn dropped, consecutive turns of one speaker joined with a blank line.
SHAREGPT_REPAIRED = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": "First.\n\nSecond."},
                     {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Done."}]  # fmt: skip


@pytest.mark.parametrize("name", ["tiny", "chatml", "qwen3"])
@pytest.mark.parametrize("mode", ["extract", "regenerate"])
def test_a_repaired_sharegpt_row_is_vllms_rendering_of_the_repaired_messages(model_config, tiny_model, name, mode):
    tok = tokenizers(tiny_model)[name]
    notes: list[str] = []
    ids, _ = encode_sample(tok, {"conversations": copy.deepcopy(SHAREGPT_MESS)}, mode=mode, notes=notes)
    want_msgs = SHAREGPT_REPAIRED if mode == "extract" else SHAREGPT_REPAIRED[:3]
    assert ids == vllm_ids(model_config, tok, want_msgs, generation_prompt=mode == "regenerate")
    assert len(notes) == 3
