"""Assistant masks for public chat-template families in their published shape
(tests/unit/connector/chat_templates.py: Phi-3.5, OLMo-2, Granite-3, DeepSeek-V3), each conversation's
whole render written out here by hand as (text, carries loss) pieces, not computed by the code
under test: several turns, a system prompt, an empty assistant turn, and tool calls where the
template renders them. Phi-3.5 writes an end-of-text footer after the final turn only; OLMo-2
writes a newline after every assistant turn but the last; DeepSeek-V3's tool results are closed
by the next assistant turn; Granite writes its tools and a default system prompt."""

from __future__ import annotations

import dataclasses
import json

import pytest

from connector.contract.sample_tokens import SampleRefused, encode_sample
from tests.unit.connector.chat_templates import (DEEPSEEK_V3, GRANITE3, GRANITE_SYSTEM, GRANITE_TOOLS_SYSTEM, LLAMA31, MISTRAL_NEMO, OLMO2,
                                      PHI4_MINI, PHI35, QWEN3, make_tokenizer)
from tests.unit.server.test_sidecar_data_rows import TOOLS, spelled

MULTI = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
         {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]  # fmt: skip
SYSTEM = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Two plus two?"},
          {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"},
          {"role": "assistant", "content": "Six."}]  # fmt: skip
EMPTY = [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""},
         {"role": "user", "content": "Now say yes."}, {"role": "assistant", "content": "Yes."}]  # fmt: skip
TOOL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "It is 21 degrees."},
]  # fmt: skip
#: Phi-4-mini's function calling: the tools in the system message's 'tools' (JSON text), the call
#: written by the model in the assistant content between <|tool_call|> and <|/tool_call|>.
PHI4_CALL = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>'
PHI4_TOOL = [{"role": "system", "content": "You call tools.", "tools": json.dumps(TOOLS)}, TOOL[0],
             {"role": "assistant", "content": PHI4_CALL}, TOOL[2], TOOL[3]]  # fmt: skip
#: Mistral-Nemo wants tool-call ids of 9 characters.
NEMO_TOOL = json.loads(json.dumps(TOOL).replace('"c1"', '"abcdefghi"'))
#: Tools go before the last user turn, so the first answer's prompt has none and the whole render has them later.
TOOLS_MOVED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."}]  # fmt: skip
CONVS = {"multi-turn": MULTI, "system": SYSTEM, "empty-turn": EMPTY, "tool-call": TOOL, "tool-call-in-content": PHI4_TOOL,
         "tool-call-9-char-ids": NEMO_TOOL, "tools-before-the-last-user-turn": TOOLS_MOVED}  # fmt: skip
WITH_TOOLS = {"tool-call", "tool-call-9-char-ids", "tools-before-the-last-user-turn"}

EOT = "<|endoftext|>"
PHI = {
    "multi-turn": [("<|user|>\nName a colour.<|end|>\n<|assistant|>\n", 0), ("Blue.<|end|>", 1),
                   ("\n<|user|>\nAnother?<|end|>\n<|assistant|>\n", 0), ("Green.<|end|>", 1), ("\n" + EOT, 0)],
    "system": [("<|system|>\nBe terse.<|end|>\n<|user|>\nTwo plus two?<|end|>\n<|assistant|>\n", 0), ("Four.<|end|>", 1),
               ("\n<|user|>\nAnd three?<|end|>\n<|assistant|>\n", 0), ("Six.<|end|>", 1), ("\n" + EOT, 0)],
    "empty-turn": [("<|user|>\nSay nothing.<|end|>\n<|assistant|>\n", 0), ("<|end|>", 1),
                   ("\n<|user|>\nNow say yes.<|end|>\n<|assistant|>\n", 0), ("Yes.<|end|>", 1), ("\n" + EOT, 0)],
}  # fmt: skip  (Phi-3.5's template has no tools and no tool role)

OLMO = {
    "multi-turn": [(EOT + "<|user|>\nName a colour.\n<|assistant|>\n", 0), ("Blue." + EOT, 1),
                   ("\n<|user|>\nAnother?\n<|assistant|>\n", 0), ("Green." + EOT, 1)],
    "system": [(EOT + "<|system|>\nBe terse.\n<|user|>\nTwo plus two?\n<|assistant|>\n", 0), ("Four." + EOT, 1),
               ("\n<|user|>\nAnd three?\n<|assistant|>\n", 0), ("Six." + EOT, 1)],
    "empty-turn": [(EOT + "<|user|>\nSay nothing.\n<|assistant|>\n", 0), (EOT, 1),
                   ("\n<|user|>\nNow say yes.\n<|assistant|>\n", 0), ("Yes." + EOT, 1)],
}  # fmt: skip  (no tools)

R, O, G = "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"
CALL = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
GRANITE = {
    "multi-turn": [(f"{R}system{O}{GRANITE_SYSTEM}{G}\n{R}user{O}Name a colour.{G}\n{R}assistant{O}", 0), (f"Blue.{G}", 1),
                   (f"\n{R}user{O}Another?{G}\n{R}assistant{O}", 0), (f"Green.{G}", 1), ("\n", 0)],
    "system": [(f"{R}system{O}Be terse.{G}\n{R}user{O}Two plus two?{G}\n{R}assistant{O}", 0), (f"Four.{G}", 1),
               (f"\n{R}user{O}And three?{G}\n{R}assistant{O}", 0), (f"Six.{G}", 1), ("\n", 0)],
    "empty-turn": [(f"{R}system{O}{GRANITE_SYSTEM}{G}\n{R}user{O}Say nothing.{G}\n{R}assistant{O}", 0), (G, 1),
                   (f"\n{R}user{O}Now say yes.{G}\n{R}assistant{O}", 0), (f"Yes.{G}", 1), ("\n", 0)],
    "tool-call": [(f"{R}system{O}{GRANITE_SYSTEM}{GRANITE_TOOLS_SYSTEM}{G}\n{R}tools{O}{json.dumps(TOOLS, indent=4)}{G}\n"
                   f"{R}user{O}Weather in Paris?{G}\n{R}assistant{O}", 0),
                  (f"<|tool_call|>{json.dumps(CALL, indent=4)}{G}", 1),
                  (f"\n{R}tool_response{O}" + '{"temp": 21}' + f"{G}\n{R}assistant{O}", 0), (f"It is 21 degrees.{G}", 1),
                  ("\n", 0)],
}  # fmt: skip

B, U, A, S = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
DEEPSEEK = {
    "multi-turn": [(f"{B}{U}Name a colour.{A}", 0), (f"Blue.{S}", 1), (f"{U}Another?{A}", 0), (f"Green.{S}", 1)],
    "system": [(f"{B}Be terse.{U}Two plus two?{A}", 0), (f"Four.{S}", 1), (f"{U}And three?{A}", 0), (f"Six.{S}", 1)],
    "empty-turn": [(f"{B}{U}Say nothing.{A}", 0), (S, 1), (f"{U}Now say yes.{A}", 0), (f"Yes.{S}", 1)],
    "tool-call": [(f"{B}{U}Weather in Paris?{A}", 0),
                  ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
                   f"<｜tool▁call▁end｜><｜tool▁calls▁end｜>{S}", 1),
                  ('<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temp": 21}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>', 0),
                  (f"It is 21 degrees.{S}", 1)],
}  # fmt: skip

PHI4 = {
    "multi-turn": [("<|user|>Name a colour.<|end|><|assistant|>", 0), ("Blue.<|end|>", 1),
                   ("<|user|>Another?<|end|><|assistant|>", 0), ("Green.<|end|>", 1), (EOT, 0)],
    "system": [("<|system|>Be terse.<|end|><|user|>Two plus two?<|end|><|assistant|>", 0), ("Four.<|end|>", 1),
               ("<|user|>And three?<|end|><|assistant|>", 0), ("Six.<|end|>", 1), (EOT, 0)],
    "empty-turn": [("<|user|>Say nothing.<|end|><|assistant|>", 0), ("<|end|>", 1),
                   ("<|user|>Now say yes.<|end|><|assistant|>", 0), ("Yes.<|end|>", 1), (EOT, 0)],
    "tool-call-in-content": [
        (f"<|system|>You call tools.<|tool|>{json.dumps(TOOLS)}<|/tool|><|end|><|user|>Weather in Paris?<|end|><|assistant|>", 0),
        (PHI4_CALL + "<|end|>", 1), ('<|tool|>{"temp": 21}<|end|><|assistant|>', 0), ("It is 21 degrees.<|end|>", 1), (EOT, 0)],
}  # fmt: skip


def h(role):
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


L, T = "<|begin_of_text|>", "<|eot_id|>"
DATED = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
LLAMA = {
    "multi-turn": [(f"{L}{h('system')}{DATED}{T}{h('user')}Name a colour.{T}{h('assistant')}", 0), (f"Blue.{T}", 1),
                   (f"{h('user')}Another?{T}{h('assistant')}", 0), (f"Green.{T}", 1)],
    "system": [(f"{L}{h('system')}{DATED}Be terse.{T}{h('user')}Two plus two?{T}{h('assistant')}", 0), (f"Four.{T}", 1),
               (f"{h('user')}And three?{T}{h('assistant')}", 0), (f"Six.{T}", 1)],
    "empty-turn": [(f"{L}{h('system')}{DATED}{T}{h('user')}Say nothing.{T}{h('assistant')}", 0), (T, 1),
                   (f"{h('user')}Now say yes.{T}{h('assistant')}", 0), (f"Yes.{T}", 1)],
    "tool-call": [(f"{L}{h('system')}Environment: ipython\n{DATED}{T}{h('user')}Given the following functions, please respond "
                   "with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n"
                   'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
                   f"Do not use variables.\n\n{json.dumps(TOOLS[0], indent=4)}\n\nWeather in Paris?{T}{h('assistant')}", 0),
                  ('{"name": "get_weather", "parameters": {"city": "Paris"}}' + T, 1),
                  (h("ipython") + json.dumps('{"temp": 21}') + T + h("assistant"), 0),  # a string result, quoted
                  (f"It is 21 degrees.{T}", 1)],
}  # fmt: skip

NEMO_TOOLS = ('[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", '
              f'"parameters": {json.dumps(TOOLS[0]["function"]["parameters"])}}}}}][/AVAILABLE_TOOLS]')
NEMO = {
    "multi-turn": [("<s>[INST]Name a colour.[/INST]", 0), ("Blue.</s>", 1), ("[INST]Another?[/INST]", 0), ("Green.</s>", 1)],
    # the system prompt goes only into a last user turn that is the conversation's last message, so the
    # render of a conversation that ends with an answer drops it: refused, not trained without it
    "system": "message 2 \\(assistant\\): the chat template renders the conversation before this turn differently",
    "empty-turn": [("<s>[INST]Say nothing.[/INST]", 0), ("</s>", 1), ("[INST]Now say yes.[/INST]", 0), ("Yes.</s>", 1)],
    "tool-call-9-char-ids": [
        (f"<s>{NEMO_TOOLS}[INST]Weather in Paris?[/INST]", 0),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]</s>', 1),
        ('[TOOL_RESULTS]{"content": {"temp": 21}, "call_id": "abcdefghi"}[/TOOL_RESULTS]', 0), ("It is 21 degrees.</s>", 1)],
    "tools-before-the-last-user-turn": [("<s>[INST]Hi[/INST]", 0), ("Hello.</s>", 1),
                                        (f"{NEMO_TOOLS}[INST]Weather in Paris?[/INST]", 0), ("Sunny.</s>", 1)],
}  # fmt: skip

EXPECTED = {PHI35.name: PHI, MISTRAL_NEMO.name: NEMO, PHI4_MINI.name: PHI4, LLAMA31.name: LLAMA, OLMO2.name: OLMO, GRANITE3.name: GRANITE, DEEPSEEK_V3.name: DEEPSEEK}
STYLE = {s.name: s for s in (PHI35, PHI4_MINI, OLMO2, GRANITE3, DEEPSEEK_V3, LLAMA31, MISTRAL_NEMO)}
CASES = [(family, conv) for family, convs in EXPECTED.items() for conv in convs]


@pytest.fixture(scope="module")
def toks(tiny_model):
    return {(name, marked): make_tokenizer(tiny_model, st, marked=marked) for name, st in STYLE.items() for marked in (False, True)}


@pytest.mark.parametrize(("family", "conv"), CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_ids_and_mask_are_the_render_spelled_out_by_hand(toks, family, conv):
    tok = toks[(family, False)]
    sample = {"messages": CONVS[conv], **({"tools": TOOLS} if conv in WITH_TOOLS else {})}
    if isinstance(EXPECTED[family][conv], str):  # refused, with this reason
        with pytest.raises(SampleRefused, match=EXPECTED[family][conv]):
            encode_sample(tok, sample)
        return
    want = spelled(tok, *EXPECTED[family][conv])
    assert encode_sample(tok, sample) == want
    # the same template with {% generation %} markers around each assistant turn agrees
    marked = toks[(family, True)]
    assert encode_sample(marked, sample) == want


#: Qwen3's reasoning handling (earlier turns lose their <think> block) with Phi-3's footer: a turn
#: that renders differently once later turns exist, in a conversation that ends with <|endoftext|>.
THINK_FOOTER = dataclasses.replace(
    QWEN3, name="qwen3-with-footer", special=(*QWEN3.special, EOT), eos=EOT,
    template=QWEN3.template.replace("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
                                    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                                    "{%- else %}{{- eos_token }}{%- endif %}"),
)  # fmt: skip

#: After gpt-oss's harmony template: the conversation's final assistant turn ends with <|return|>
#: (the stop token of a finished reply), a turn with later turns after it with <|end|>. What
#: differs from the render with the generation prompt is the turn's own end, not a footer.
FINAL_STOP = (
    "{%- for m in messages %}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] }}"
    "{%- if m['role'] == 'assistant' and loop.last and not add_generation_prompt %}{{- '<|return|>' }}"
    "{%- else %}{{- '<|end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
FINAL_STOP_STYLE = dataclasses.replace(PHI35, name="final-stop-token", template=FINAL_STOP,
                                       special=("<|start|>", "<|message|>", "<|end|>", "<|return|>"), eos="<|return|>")  # fmt: skip


def test_footer_after_a_turn_that_renders_differently_later(tiny_model):
    tok = make_tokenizer(tiny_model, THINK_FOOTER)
    msgs = [{"role": "user", "content": "Think first."},
            {"role": "assistant", "content": "Done.", "reasoning_content": "hmm, easy"},
            {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Yes.", "reasoning_content": "still easy"}]  # fmt: skip
    s, e = "<|im_start|>", "<|im_end|>"
    want = spelled(tok, (f"{s}user\nThink first.{e}\n{s}assistant\n", 0), (f"Done.{e}", 1),
                   (f"\n{s}user\nAgain?{e}\n{s}assistant\n", 0), (f"<think>\nstill easy\n</think>\n\nYes.{e}", 1),
                   ("\n" + EOT, 0))  # fmt: skip
    assert encode_sample(tok, {"messages": msgs}) == want


def test_a_final_turn_that_ends_with_its_own_stop_token_keeps_it(tiny_model):
    tok = make_tokenizer(tiny_model, FINAL_STOP_STYLE)
    want = spelled(tok, ("<|start|>user<|message|>Name a colour.<|end|><|start|>assistant", 0), ("<|message|>Blue.<|end|>", 1),
                   ("<|start|>user<|message|>Another?<|end|><|start|>assistant", 0), ("<|message|>Green.<|return|>", 1))  # fmt: skip
    assert encode_sample(tok, {"messages": MULTI}) == want
