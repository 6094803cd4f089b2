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

STYLES = (CHATML, LLAMA3, MISTRAL, GEMMA, LLAMA2, QWEN3)


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
