"""Chat templates in the styles users bring, written for the tests, and tokenizers to render them.

Each template is written without generation markers; ``GEN``/``END`` show where a marked
variant would put ``{% generation %}``/``{% endgeneration %}``, so a test can compare the
marker-free mask with the marked one. ``expect(content)`` is the text an assistant turn's
mask must decode to (its content as the template writes it, plus the end-of-turn token).

The tokenizers reuse the tiny verifier's byte-level BPE (hsstream/tiny_model.py) with the
special tokens each style needs added; the styles whose models prepend a BOS to a plain
prompt (Llama, Mistral, Gemma) get a post-processor that does so, as their tokenizers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

GEN, END = "<<GEN>>", "<<END>>"


def system_apart(var: str, *, sep: str = "", absent: str = "''") -> str:
    """Jinja that takes a leading system message out of the turns, as templates that fold it
    into a user turn do: its content (+ ``sep``) into ``var`` (``absent`` when there is none),
    the remaining turns into ``loop_messages``."""
    value = "messages[0]['content']" + (f" + '{sep}'" if sep else "")
    return ("{%- if messages[0]['role'] == 'system' %}{%- set " + var + " = " + value + " %}"
            "{%- set loop_messages = messages[1:] %}{%- else %}{%- set " + var + " = " + absent + " %}"
            "{%- set loop_messages = messages %}{%- endif %}")  # fmt: skip


def generation_prompt(header: str) -> str:
    """Jinja that opens the assistant's turn with ``header`` when add_generation_prompt is set."""
    return "{%- if add_generation_prompt %}{{- '" + header + "' }}{%- endif %}"


@dataclass(frozen=True)
class Style:
    name: str
    template: str
    special: tuple[str, ...]
    bos: str | None
    eos: str
    expect: Callable[[str], str]
    added: tuple[str, ...] = field(default=())  # added tokens that are not special (Qwen3's <think>)
    last_turn_prefix: str = ""  # what the template writes before the content of the final turn only

    def render(self, marked: bool) -> str:
        g, e = ("{% generation %}", "{% endgeneration %}") if marked else ("", "")
        return self.template.replace(GEN, g).replace(END, e)


CHATML = Style(
    "chatml",
    # Qwen2.5: a default system prompt when the conversation has none.
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}" + GEN + "{{- m['content'] + '<|im_end|>' }}" + END + "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    + generation_prompt("<|im_start|>assistant\\n"),
    ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
    lambda c: c + "<|im_end|>",
)

LLAMA3 = Style(
    "llama3",
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['role'] == 'assistant' %}" + GEN + "{{- m['content'] | trim + '<|eot_id|>' }}" + END +
    "{%- else %}{{- m['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    + generation_prompt("<|start_header_id|>assistant<|end_header_id|>\\n\\n"),
    ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|begin_of_text|>", "<|eot_id|>",
    lambda c: c.strip() + "<|eot_id|>",
)

MISTRAL = Style(
    "mistral",
    # [INST] … [/INST] answer</s>; roles must alternate; a system prompt joins the first [INST].
    system_apart("sys", sep="\\n\\n") +
    "{{- bos_token }}"
    "{%- for m in loop_messages %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if m['role'] == 'user' %}{{- '[INST] ' + (sys if loop.first else '') + m['content'] + ' [/INST]' }}"
    "{%- else %}" + GEN + "{{- m['content'] + eos_token }}" + END + "{%- endif %}"
    "{%- endfor %}",
    ("<s>", "</s>"), "<s>", "</s>",
    lambda c: c + "</s>",
)

GEMMA = Style(
    "gemma",
    "{{- bos_token }}"
    + system_apart("first", sep="\\n\\n") +
    "{%- for m in loop_messages %}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' }}"
    "{%- if role == 'model' %}" + GEN + "{{- m['content'] | trim + '<end_of_turn>' }}" + END + "{{- '\\n' }}"
    "{%- else %}{{- (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}{%- endif %}"
    "{%- endfor %}"
    + generation_prompt("<start_of_turn>model\\n"),
    ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>",
    lambda c: c.strip() + "<end_of_turn>",
)

LLAMA2 = Style(
    "llama2-system-folded",
    # Llama-2: the system prompt folded into the first user turn inside <<SYS>>, a BOS per
    # exchange, the answer written as ' answer </s>'.
    system_apart("sys", absent="false") +
    "{%- for m in loop_messages %}"
    "{%- if loop.index0 == 0 and sys != false %}"
    "{%- set content = '<<SYS>>\\n' + sys + '\\n<</SYS>>\\n\\n' + m['content'] %}"
    "{%- else %}{%- set content = m['content'] %}{%- endif %}"
    "{%- if m['role'] == 'user' %}{{- bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{%- else %}" + GEN + "{{- ' ' + content.strip() + ' ' + eos_token }}" + END + "{%- endif %}"
    "{%- endfor %}",
    ("<s>", "</s>"), "<s>", "</s>",
    lambda c: " " + c.strip() + " </s>",
)

QWEN3 = Style(
    "qwen3-thinking",
    # Qwen3's reasoning handling: turns after the last user query show their reasoning (the
    # last one always gets a <think> block), earlier turns lose it. So a turn renders
    # differently once later turns exist.
    "{%- set ns = namespace(last_query=messages|length - 1, found=false) %}"
    "{%- for m in messages[::-1] %}{%- if m['role'] == 'user' and not ns.found %}{%- set ns.found = true %}"
    "{%- set ns.last_query = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = m['reasoning_content'] or '' %}"
    "{{- '<|im_start|>assistant\\n' }}" + GEN +
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- content }}{%- endif %}"
    "{{- '<|im_end|>' }}" + END + "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    + generation_prompt("<|im_start|>assistant\\n"),
    ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
    lambda c: c + "<|im_end|>",
    added=("<think>", "</think>"),
    last_turn_prefix="<think>\n\n</think>\n\n",
)

MISTRAL_SYSTEM_LAST = Style(
    "mistral-system-at-last-user",
    # Mistral v0.3's habit: the system prompt goes into the LAST user turn, so the prompt of
    # an earlier assistant turn is no prefix of the whole conversation.
    system_apart("sys") +
    "{%- set ns = namespace(last_user=0) %}{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for m in loop_messages %}"
    "{%- if m['role'] == 'user' %}"
    "{%- if loop.index0 == ns.last_user and sys %}{{- '[INST] ' + sys + '\\n\\n' + m['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}",
    ("<s>", "</s>"), "<s>", "</s>",
    lambda c: " " + c + "</s>",
)

def make_tokenizer(tiny_model: str, style: Style, *, marked: bool = False):
    """The tiny verifier's BPE with the style's special tokens and (un)marked template."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(Path(tiny_model) / "tokenizer.json"))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in style.special])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in style.added])
    byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if style.bos:
        bos = (style.bos, raw.token_to_id(style.bos))
        raw.post_processor = processors.Sequence(
            [byte_level, processors.TemplateProcessing(single=f"{style.bos} $A", pair=f"{style.bos} $A {style.bos} $B",
                                                       special_tokens=[bos])]  # fmt: skip
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=style.bos, eos_token=style.eos, unk_token=None,
        clean_up_tokenization_spaces=False, chat_template=style.render(marked),
    )  # fmt: skip


# ---------------------------------------------------------------- public families, in their published shape
# Written from the templates in each model's tokenizer_config.json (chat_template), Jinja kept as
# published except where a comment says otherwise; GEN/END mark where a marked variant would put
# its {% generation %} block (the content and the end-of-turn token the model generates).

PHI35 = Style(
    "phi-3.5",
    # microsoft/Phi-3.5-mini-instruct (and Phi-3-mini-4k-instruct since its July 2024 update):
    # <|role|>\n…<|end|>\n per turn, and eos_token (<|endoftext|>) written once after the
    # conversation's final turn when no generation prompt follows: a conversation-level footer.
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n'}}" + GEN + "{{message['content'] + '<|end|>'}}" + END +
    "{{'\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}",
    ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), None, "<|endoftext|>",
    lambda c: c + "<|end|>",
)

OLMO2 = Style(
    "olmo-2",
    # allenai/OLMo-2-1124-7B-Instruct (the Tulu-3 template): the role markers are plain text, the
    # BOS and the end of an assistant turn are both <|endoftext|>, and an assistant turn is
    # followed by '\n' only when it is not the conversation's last message, so a turn renders
    # differently once later turns exist.
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\\n' }}" + GEN + "{{ message['content'] + eos_token }}" + END + "{{ '\\n' }}"
    "{% else %}{{ '<|assistant|>\\n' }}" + GEN + "{{ message['content'] + eos_token }}" + END + "{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}",
    ("<|endoftext|>",), "<|endoftext|>", "<|endoftext|>",
    lambda c: c + "<|endoftext|>",
)

#: Granite's default system prompt when a conversation has none; the published template puts
#: today's date into it with strftime_now, fixed here so the renders are reproducible.
GRANITE_SYSTEM = "Knowledge Cutoff Date: April 2024.\nToday's Date: December 01, 2026.\nYou are Granite, developed by IBM."
GRANITE_TOOLS_SYSTEM = (
    " You are a helpful AI assistant with access to the following tools. When a tool is required to answer the "
    "user's query, respond with <|tool_call|> followed by a JSON list of tools used. If a tool does not exist in the "
    "provided list of tools, notify the user that you do not have the ability to fulfill the request."
)

GRANITE3 = Style(
    "granite-3",
    # ibm-granite/granite-3.1-8b-instruct: <|start_of_role|>role<|end_of_role|>…<|end_of_text|>\n,
    # a default system prompt, the tools as JSON in their own turn, tool calls after <|tool_call|>,
    # tool results as a tool_response turn. (The documents and controls branches are left out.)
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system_message = \"" + GRANITE_SYSTEM.replace("\n", "\\n")
    + "\" %}{%- if tools %}{%- set system_message = system_message + \"" + GRANITE_TOOLS_SYSTEM + "\" %}{%- endif %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}"
    "{%- if tools %}{{- '<|start_of_role|>tools<|end_of_role|>' }}{{- tools | tojson(indent=4) }}"
    "{{- '<|end_of_text|>\\n' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' }}" + GEN +
    "{{- '<|tool_call|>' + message.tool_calls | map(attribute='function') | list | tojson(indent=4) + '<|end_of_text|>' }}"
    + END + "{{- '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|start_of_role|>tool_response<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}" + GEN +
    "{{- message['content'] + '<|end_of_text|>' }}" + END + "{{- '\\n' }}"
    "{%- else %}{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{%- endif %}"
    "{%- if loop.last and add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
    "{%- endfor %}",
    ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"), None, "<|end_of_text|>",
    lambda c: c + "<|end_of_text|>",
)

DEEPSEEK_V3 = Style(
    "deepseek-v3",
    # deepseek-ai/DeepSeek-V3: every system message joined at the start after the BOS, then
    # <｜User｜>… and <｜Assistant｜>…<｜end▁of▁sentence｜> with nothing between turns; tool calls in
    # <｜tool▁calls▁begin｜>…, tool results in <｜tool▁outputs▁begin｜>… whose closing token the
    # next assistant turn (or the generation prompt, instead of <｜Assistant｜>) writes. The
    # arguments go through tojson, as vLLM's examples/tool_chat_template_deepseekv3.jinja has it
    # (the published template concatenates a string; vLLM hands templates a mapping).
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{{'<｜Assistant｜>'}}" + GEN + "{{message['content']}}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}"
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] | tojson + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- set ns.is_first = true -%}{%- else %}"
    "{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] | tojson + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}" + END +
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}" + GEN + "{{message['content'] + '<｜end▁of▁sentence｜>'}}" + END +
    "{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{{'<｜Assistant｜>'}}" + GEN + "{{content + '<｜end▁of▁sentence｜>'}}"
    + END + "{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}"
    "{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}"
    "{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}",
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
     "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
     "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
    lambda c: c + "<｜end▁of▁sentence｜>",
)


PHI4_MINI = Style(
    "phi-4-mini",
    # microsoft/Phi-4-mini-instruct: <|role|>…<|end|> with nothing between turns, a system
    # message's 'tools' (a JSON string) in <|tool|>…<|/tool|>, and eos_token (<|endoftext|>) after
    # the final turn when no generation prompt follows. (The assistant branch is split out of the
    # published one-for-all-roles expression so a marked variant can mark it; same text.)
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' }}" + GEN + "{{ message['content'] + '<|end|>' }}" + END +
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}",
    ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>", "<|tool_call|>",
     "<|/tool_call|>"), None, "<|endoftext|>",
    lambda c: c + "<|end|>",
)

LLAMA31 = Style(
    "llama-3.1-tools",
    # meta-llama/Llama-3.1-8B-Instruct: a system turn with the knowledge-cutoff header always, the
    # tools (tools_in_user_message, the default) folded into the first user turn, a tool call as
    # {"name": …, "parameters": …}<|eot_id|>, tool results as an ipython turn (through tojson: a
    # string result comes out quoted, as published). (The builtin_tools branches are left out.)
    "{{- bos_token }}"
    "{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}"
    "{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}"
    "{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = \"\" %}{%- endif %}"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
    "{%- if tools is not none %}{{- \"Environment: ipython\\n\" }}{%- endif %}"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}{{- \"Today Date: \" + date_string + \"\\n\\n\" }}"
    "{{- system_message }}{{- \"<|eot_id|>\" }}"
    "{%- if tools_in_user_message and not tools is none %}"
    "{%- if messages | length != 0 %}{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{{- raise_exception(\"Cannot put tools in the first user message when there's no first user message!\") }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- \"Given the following functions, please respond with a JSON for a function call \" }}"
    "{{- \"with its proper arguments that best answers the given prompt.\\n\\n\" }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}"
    "{{- \"Do not use variables.\\n\\n\" }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- \"\\n\\n\" }}{%- endfor %}"
    "{{- first_user_message + \"<|eot_id|>\"}}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}" + GEN +
    "{{- message['content'] | trim + '<|eot_id|>' }}" + END +
    "{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls|length == 1 %}{{- raise_exception(\"This model only supports single tool-calls at once!\") }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}" + GEN +
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- \"}\" }}"
    "{{- \"<|eot_id|>\" }}" + END +
    "{%- elif message.role == \"tool\" or message.role == \"ipython\" %}"
    "{{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}{{- \"<|eot_id|>\" }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
    ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"), "<|begin_of_text|>",
    "<|eot_id|>",
    lambda c: c.strip() + "<|eot_id|>",
)


MISTRAL_NEMO = Style(
    "mistral-nemo-v3-tekken",
    # mistralai/Mistral-Nemo-Instruct-2407 (v3, tekken): [INST]…[/INST]answer</s> with nothing in
    # between; the system prompt only in the last user turn and only when that turn is the
    # conversation's last message (so a conversation that ends with an answer has none), the
    # tools before the last user turn, calls as [TOOL_CALLS][…, "id": …]</s>, results in
    # [TOOL_RESULTS]…[/TOOL_RESULTS]; no generation prompt. The prompt of an earlier turn is then
    # no prefix of the whole render.
    '{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}'
    '{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}'
    '{%- if not tools is defined %}{%- set tools = none %}{%- endif %}'
    '{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}'
    '{%- set ns = namespace() %}{%- set ns.index = 0 %}{%- for message in loop_messages %}'
    '{%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}'
    '{%- if (message["role"] == "user") != (ns.index % 2 == 0) %}'
    '{{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}'
    '{%- endif %}{%- set ns.index = ns.index + 1 %}{%- endif %}{%- endfor %}'
    '{{- bos_token }}'
    '{%- for message in loop_messages %}'
    '{%- if message["role"] == "user" %}'
    '{%- if tools is not none and (message == user_messages[-1]) %}{{- "[AVAILABLE_TOOLS][" }}'
    '{%- for tool in tools %}{%- set tool = tool.function %}{{- \'{"type": "function", "function": {\' }}'
    '{%- for key, val in tool.items() if key != "return" %}'
    '{%- if val is string %}{{- \'"\' + key + \'": "\' + val + \'"\' }}{%- else %}{{- \'"\' + key + \'": \' + val|tojson }}{%- endif %}'
    '{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}{{- "}}" }}'
    '{%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}{%- endfor %}{{- "[/AVAILABLE_TOOLS]" }}{%- endif %}'
    '{%- if loop.last and system_message is defined %}{{- "[INST]" + system_message + "\\n\\n" + message["content"] + "[/INST]" }}'
    '{%- else %}{{- "[INST]" + message["content"] + "[/INST]" }}{%- endif %}'
    '{%- elif (message.tool_calls is defined and message.tool_calls is not none) %}' + GEN + '{{- "[TOOL_CALLS][" }}'
    '{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}'
    '{%- if not tool_call.id is defined or tool_call.id|length != 9 %}'
    '{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}'
    '{{- \', "id": "\' + tool_call.id + \'"}\' }}{%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}'
    '{%- endfor %}' + END +
    '{%- elif message["role"] == "assistant" %}' + GEN + '{{- message["content"] + eos_token}}' + END +
    '{%- elif message["role"] == "tool_results" or message["role"] == "tool" %}'
    '{%- if message.content is defined and message.content.content is defined %}{%- set content = message.content.content %}'
    '{%- else %}{%- set content = message.content %}{%- endif %}'
    '{{- \'[TOOL_RESULTS]{"content": \' + content|string + ", " }}'
    '{%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}'
    '{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}'
    '{{- \'"call_id": "\' + message.tool_call_id + \'"}[/TOOL_RESULTS]\' }}'
    '{%- else %}{{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}'
    '{%- endif %}{%- endfor %}',
    ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
     "[/TOOL_RESULTS]"), "<s>", "</s>",
    lambda c: c + "</s>",
)

#: The public families whose renders of the generic test conversations all have a mask (Mistral-Nemo drops the
#: system prompt of a conversation that ends with an answer, which is refused: tests/unit/connector/test_template_families.py).
FAMILIES = (PHI35, PHI4_MINI, OLMO2, GRANITE3, DEEPSEEK_V3, LLAMA31)

STYLES = (CHATML, LLAMA3, MISTRAL, GEMMA, LLAMA2, QWEN3, *FAMILIES)
