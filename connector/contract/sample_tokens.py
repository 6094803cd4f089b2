"""Token ids and loss masks of a REST sample: the one implementation the sidecar and the trainer share.

The sidecar tokenises every sample before vLLM sees it (vLLM gets token ids, never text), and a
trainer that counts tokens locally for its draft vocabulary must get the same ids and masks,
or its vocabulary is picked from other data than it trains on. So both import this module.
It is one of the contracts (``connector/contract/``), the package every role installs (the
trainer installs without the server); like them it imports no heavy library at import time:
the tokenizer is a transformers object the caller passes in (:func:`load_tokenizer` imports
transformers lazily), so ``import trainer_client`` stays free of transformers.

Token ids are what ``vllm serve`` would compute for the same text: a plain prompt is encoded
with the tokenizer's special tokens (``add_special_tokens=True``, e.g. Llama's BOS, as vLLM
does for a completion prompt); a conversation is rendered by the chat template and encoded
without adding any (the template writes its own BOS, as vLLM does for chat).

The assistant mask (which positions carry loss) works with every chat template:

* a template with ``{% generation %}`` markers: the marked characters (transformers'
  ``return_assistant_tokens_mask``), as the template's author meant;
* any other template: the conversation is rendered turn by turn. For assistant turn *i*, the
  render of the turns before it plus the generation prompt (exactly what the model would be
  prompted with) must be a token prefix of the whole conversation's render; the turn's tokens
  start there. They are what the render up to and including the turn adds, without a footer the
  template writes after the final turn only when no generation prompt follows (Phi-3's
  ``<|endoftext|>``: what that render has where the render with the generation prompt parts from
  it, :func:`_turn_without_footer`), kept through their last special token (``<|im_end|>``,
  ``<|eot_id|>``, ``</s>``, ``<end_of_turn>``), dropping the separator the template writes after
  it (ChatML's ``\\n``), which the model never generates. Templates that render a turn
  differently once later turns exist (Qwen3 drops the reasoning of earlier turns; a final turn
  that ends with a stop token of its own) make that render no prefix; then the turn ends, in the
  whole render, after as many special tokens as it has from where the two renders part. When
  even the prompt before a turn is no prefix (a template that moves the system prompt to the
  last user turn), the turn's own tokens (content through its end-of-turn token) are looked for
  in the whole render after the previous assistant turn; found exactly once, that is the turn,
  else the sample is refused: no mask could be trusted.

Where the prompt differs from the whole render only inside the generation prompt (Qwen3 with
``enable_thinking=False``), the turn starts where the two part.

Rows come as datasets ship them (:func:`chat_messages`): OpenAI content-part lists, assistant
``tool_calls`` with null content, ``tool`` messages, a sample's ``tools``, ShareGPT's tool
speakers, ``developer`` messages, each turned into what vLLM's chat rendering hands the template,
so the ids stay those of ``vllm serve``. An assistant turn that calls tools carries loss like any
other; a tool's result does not.

So the generation-prompt header (``<|im_start|>assistant\\n``) never carries loss and the
end-of-turn token always does. A conversation with no assistant token at all is refused
rather than trained on with an all-zero mask.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

#: ShareGPT speakers → chat roles. ``gpt`` and the other assistants ShareGPT V3 records
#: (``chatgpt``, ``bing``, ``bard``) are the assistant. ``function_call`` (the assistant calling a
#: tool, its value the call as JSON ``{"name": …, "arguments": …}``, as glaive / LLaMA-Factory rows
#: write it) becomes an assistant turn with ``tool_calls``; ``observation`` / ``tool`` /
#: ``function_response`` (the tool's answer) a ``tool`` turn.
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bing": "assistant", "bard": "assistant", "system": "system",
    "function_call": "assistant", "tool": "tool", "observation": "tool", "function_response": "tool",
}  # fmt: skip

#: The repairs a ShareGPT conversation may get (:func:`sharegpt_messages`), as counted per job.
REPAIR_EMPTY = "empty turns dropped"
REPAIR_LEADING = "turns before the first user turn dropped"
REPAIR_MERGED = "consecutive turns of one speaker merged"

#: Content-part types whose text vLLM's chat rendering keeps (vllm/renderers/chat_utils.py
#: ``TEXT_PART_TYPES``) and the key each keeps its text under.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}

#: apply_chat_template arguments the sidecar sets itself; a job's chat_template_kwargs may not.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip

#: How transformers recognises a template with generation markers (its own test, verbatim).
_MARKERS = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class SampleRefused(ValueError):
    """A sample that cannot become training data; the message says why, for the job's error list.
    ``reason``: the short kind of refusal a job's skipped samples are counted by (default: the
    message without its place in the sample and its figures, :func:`reason_of`)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or reason_of(message)


_PLACE = re.compile(r"^(message \d+( \([a-z_]+\))?|conversations\[\d+\]( \([a-z_]+\))?): ")


def reason_of(message: str) -> str:
    """A refusal's kind from its message: without the place (``message 3: ``), cut at its first
    ``:`` or ``(``, figures as ``N`` (``"sample has N tokens, more than the limit of N"``)."""
    m = re.split(r"[:(]", _PLACE.sub("", message), maxsplit=1)[0].strip()
    return re.sub(r"\d[\d,.]*", "N", m)[:100] or "refused"


def load_tokenizer(model: str) -> Any:
    """The verifier's tokenizer (a folder or hub id); imports transformers only when called."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def sample_messages(sample: dict, notes: list[str] | None = None) -> list[dict]:
    """The chat messages of a sample given as ``messages`` (as written: vLLM takes them so) or
    ShareGPT ``conversations`` (mapped and repaired: :func:`sharegpt_messages`, whose repairs are
    appended to ``notes``); see :func:`chat_messages` for what the template gets."""
    if sample.get("messages") is not None:
        msgs = [dict(m) for m in sample["messages"]]
    else:
        msgs = sharegpt_messages(sample.get("conversations") or [], notes)
    if not msgs:
        raise SampleRefused("empty conversation")
    return msgs


def sharegpt_messages(turns: list[dict], notes: list[str] | None = None) -> list[dict]:
    """A ShareGPT conversation as chat messages, repaired as ShareGPT's own cleaning (FastChat,
    the EAGLE recipes) repairs it, in this order, each repair named once in ``notes``:

    1. every speaker mapped (:data:`SHAREGPT_ROLES`); an unknown one refuses the sample;
    2. a user, assistant or system turn whose text is empty or blank is dropped (an empty reply
       would train only its end-of-turn token);
    3. turns before the first user turn are dropped, system turns aside (ShareGPT V3 splits
       long conversations, so a third of its parts open with the assistant's reply to a question
       in the previous part); a conversation without a user turn is refused ("no user turn");
    4. consecutive text turns of one speaker are merged into one, joined with a blank line.

    Tool turns (``function_call``, ``observation``) are kept as they are. The ``messages`` of an
    OpenAI row get none of this: vLLM's chat completions take them as sent, and so does the sidecar."""
    msgs: list[dict] = []
    for k, t in enumerate(turns):
        role = SHAREGPT_ROLES.get(t.get("from"))
        if role is None:
            raise SampleRefused(f"unknown ShareGPT speaker {t.get('from')!r} (known: {', '.join(SHAREGPT_ROLES)})")
        if t.get("from") == "function_call":
            msgs.append({"role": "assistant", "content": None, "tool_calls": _sharegpt_calls(k, t.get("value"))})
        else:
            msgs.append({"role": role, "content": t.get("value")})
    if not msgs:
        return msgs

    def text(m: dict) -> bool:
        return m["role"] in ("user", "assistant", "system") and "tool_calls" not in m and isinstance(m["content"], str)

    def note(what: str) -> None:
        if notes is not None and what not in notes:
            notes.append(what)

    kept = [m for m in msgs if not (text(m) and not m["content"].strip())]
    if not kept:
        raise SampleRefused("empty conversation: every turn is blank", reason="empty conversation")
    if len(kept) < len(msgs):
        note(REPAIR_EMPTY)
    first = next((i for i, m in enumerate(kept) if m["role"] == "user"), None)
    if first is None:
        raise SampleRefused("no user turn: the conversation has no non-empty human/user turn", reason="no user turn")
    lead = [m for m in kept[:first] if m["role"] == "system"]
    if len(lead) < first:
        note(REPAIR_LEADING)
    out: list[dict] = []
    for m in [*lead, *kept[first:]]:
        if out and text(m) and text(out[-1]) and out[-1]["role"] == m["role"]:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
            note(REPAIR_MERGED)
        else:
            out.append(m)
    return out


def _sharegpt_calls(k: int, value: Any) -> list[dict]:
    try:
        call = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        call = None
    calls = call if isinstance(call, list) else [call]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise SampleRefused(
            f"conversations[{k}] (function_call): its value must be a JSON object "
            '{"name": ..., "arguments": {...}} (or a list of them)', reason="malformed function_call turn",
        )  # fmt: skip
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def _prompt_repeats_first_user_turn(sample: dict, msgs: list[dict]) -> None:
    """UltraChat rows carry ``prompt`` beside ``messages``: the messages win when the prompt is
    their first user turn (whitespace at the ends aside); any other prompt is refused."""
    prompt = sample.get("prompt")
    if prompt is None:
        return
    first = next((m for m in msgs if m.get("role") == "user"), None)
    text = _text_of(first.get("content")) if first else None
    if text is None or prompt.strip() != text.strip():
        raise SampleRefused(
            "the sample has both prompt and a conversation, and the prompt is not the conversation's first "
            "user turn: send one of them (a prompt that repeats the first user turn, as UltraChat rows do, is ignored)"
        )


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        try:
            return "\n".join(_part_texts(-1, content))
        except SampleRefused:
            return None
    return None


def _part_texts(i: int, parts: list) -> list[str]:
    """The texts of a content-part list, as vLLM takes them; other part types are refused."""
    out = []
    for j, p in enumerate(parts):
        if isinstance(p, str):
            out.append(p)
            continue
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in TEXT_PARTS:
            what = f"type {kind!r}" if isinstance(kind, str) else "no type"
            raise SampleRefused(
                f"message {i}: content part {j} has {what}: only text parts ({', '.join(TEXT_PARTS)}) can be "
                "extracted (the sidecar sends vLLM token ids, so images, audio and files have no place)"
            )
        text = p.get(TEXT_PARTS[kind])
        if text is None:  # vLLM skips a text part without text
            continue
        if not isinstance(text, str):
            raise SampleRefused(f"message {i}: content part {j} ({kind}): its {TEXT_PARTS[kind]!r} is not a string")
        out.append(text)
    return out


def chat_messages(msgs: list[dict], content_format: str) -> list[dict]:
    """The messages as vLLM's chat rendering hands them to the template
    (vllm/renderers/chat_utils.py ``_parse_chat_message_content``, ``_postprocess_messages``):

    * content: for a template that reads strings (``content_format="string"``) a content-part
      list becomes its text parts joined with ``"\n"`` and ``null`` becomes ``""``; for a template
      that loops over parts (``"openai"``) a string becomes ``[{"type": "text", "text": …}]``,
      a list keeps its text parts as ``{"type": "text", "text": …}`` and ``null`` becomes ``[]``.
      A ``tool`` message's text parts are always joined into a string.
    * assistant ``reasoning`` / ``reasoning_content`` (either): given to the template as both.
    * assistant ``tool_calls``: arguments given as a JSON string become the object (templates
      expect a mapping; not JSON or not an object: ``{}``, as vLLM does); an empty list is dropped.
    """
    out = []
    for i, m in enumerate(msgs):
        m = dict(m)
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise SampleRefused(f"message {i}: content must be a string, a list of content parts or null")
        texts = [content] if isinstance(content, str) else _part_texts(i, content or [])
        if m.get("role") == "tool" or content_format != "openai":
            m["content"] = "\n".join(texts)
        else:
            m["content"] = [{"type": "text", "text": t} for t in texts]
        if m.get("role") == "assistant":  # vLLM takes either name and hands the template both
            why = m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content")
            if why is not None:
                m["reasoning"] = m["reasoning_content"] = why
        if m.get("role") == "assistant" and "tool_calls" in m:
            calls = m["tool_calls"]
            if calls is None or calls == []:
                m.pop("tool_calls")
            elif not isinstance(calls, list):
                raise SampleRefused(f"message {i}: tool_calls must be a list of calls")
            else:
                m["tool_calls"] = [_tool_call(i, k, c) for k, c in enumerate(calls)]
        out.append(m)
    return out


def developer_as_system(msgs: list[dict], template: str) -> list[dict]:
    """``developer`` messages for a template that does not know the role, as vLLM renders them
    (vllm/renderers/hf.py ``_convert_developer_to_system``, ``_consolidate_system_messages``):
    they become ``system`` messages, and when that leaves a system message anywhere but first,
    or more than one, all system contents are merged, in order and joined with ``"\n\n"``, into
    one at the start (a part list's texts joined with ``"\n"`` first)."""
    if not any(m.get("role") == "developer" for m in msgs) or '"developer"' in template or "'developer'" in template:
        return msgs
    msgs = [({**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m.get("role") == "developer" else m)
            for m in msgs]  # fmt: skip
    sys_at = [i for i, m in enumerate(msgs) if m["role"] == "system"]
    if not sys_at or sys_at == [0]:
        return msgs
    texts = []
    for i in sys_at:
        c = msgs[i].get("content", "")
        if isinstance(c, list):
            c = "\n".join(p["text"] if isinstance(p, dict) else p for p in c if isinstance(p, str) or "text" in p)
        if c:
            texts.append(c)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in msgs if m["role"] != "system")]


def _tool_call(i: int, k: int, call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
        raise SampleRefused(
            f"message {i}: tool_calls[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
            "\"arguments\": ...}}}"
        )
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except json.JSONDecodeError:
            args = {}
    if not isinstance(args, dict):
        args = {}
    return {**call, "function": {**fn, "arguments": args}}


def sample_tools(sample: dict) -> list[dict] | None:
    """A sample's ``tools`` (OpenAI function specs), a list or the JSON text of one (LLaMA-Factory
    rows carry it as a string); handed to the template as ``apply_chat_template(tools=...)``."""
    tools = sample.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise SampleRefused(f"tools: not a JSON list ({e.msg})") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise SampleRefused("tools must be a list of objects (OpenAI function specs)")
    return tools


def encode_sample(
    tok: Any, sample: dict, *, loss_mask: str = "assistant", mode: str = "extract",
    chat_template: str | None = None, chat_template_kwargs: dict | None = None, notes: list[str] | None = None,
) -> tuple[list[int], list[int]]:  # fmt: skip
    """(token ids, loss mask) of one REST sample (a dict with ``prompt``, ``messages``,
    ``conversations`` or ``token_ids``, and for a conversation optionally ``tools``); raises
    :class:`SampleRefused` with the reason. ``chat_template`` (the job's own, else the
    tokenizer's) and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``) go to
    every ``apply_chat_template`` call, as vLLM passes them. The repairs a ShareGPT conversation
    got (:func:`sharegpt_messages`) are appended to ``notes``.

    ``mode="regenerate"``: vLLM writes the reply, so the data's trailing assistant turns are
    dropped, the prompt ends with the generation prompt, and nothing of it carries loss.
    """
    train = 0 if mode == "regenerate" else 1
    if sample.get("token_ids") is not None:
        ids = list(sample["token_ids"])
        return ids, [train] * len(ids)
    if sample.get("prompt") is not None and sample.get("messages") is None and sample.get("conversations") is None:
        if not sample["prompt"]:
            raise SampleRefused("empty prompt")
        ids = list(tok(sample["prompt"], add_special_tokens=True)["input_ids"])  # as vLLM encodes a prompt
        return ids, [train] * len(ids)
    raw = sample_messages(sample, notes)
    _prompt_repeats_first_user_turn(sample, raw)
    bad = sorted(set(chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise SampleRefused(f"chat_template_kwargs may not set {', '.join(bad)} (the sidecar sets them)")
    extra: dict = {**(chat_template_kwargs or {})}
    if chat_template is not None:
        extra["chat_template"] = chat_template
    tools = sample_tools(sample)
    if tools is not None:
        extra["tools"] = tools
    template = _template(tok, chat_template)
    msgs = developer_as_system(chat_messages(raw, content_format(template)), template)
    if mode == "regenerate":
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise SampleRefused("nothing left to prompt with after removing the assistant reply")
        ids = _chat_ids(tok, msgs, generation_prompt=True, extra=extra)
        return ids, [0] * len(ids)
    if loss_mask == "all":
        ids = _chat_ids(tok, msgs, generation_prompt=False, extra=extra)
        return ids, [1] * len(ids)
    return assistant_mask(tok, msgs, extra=extra)


def assistant_mask(tok: Any, messages: list[dict], *, extra: dict | None = None) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, 1 on each assistant turn's tokens and its
    end-of-turn token, 0 elsewhere; an assistant turn that calls tools is trained on like any
    other, a ``tool`` result is not). See the module docstring for the method. ``extra``: more
    ``apply_chat_template`` arguments (``tools``, ``chat_template``, the job's template kwargs)."""
    extra = extra or {}
    if _MARKERS.search(_template(tok, extra.get("chat_template"))):
        ids, mask = _marked_mask(tok, messages, extra=extra)
    else:
        ids, mask = turn_by_turn_mask(tok, messages, extra=extra)
    if not any(mask):
        roles = ", ".join(sorted({m["role"] for m in messages}))
        raise SampleRefused(
            f"no assistant tokens to train on (roles in the conversation: {roles}): a loss mask of all "
            "zeros teaches nothing; send at least one assistant turn, or loss_mask='all'", reason="no assistant turn",
        )  # fmt: skip
    return ids, mask


def turn_by_turn_mask(tok: Any, messages: list[dict], *, extra: dict | None = None) -> tuple[list[int], list[int]]:
    """The mask from incremental renders (no generation markers needed)."""
    extra = extra or {}
    full = _chat_ids(tok, messages, generation_prompt=False, extra=extra)
    mask = [0] * len(full)
    special = _special_ids(tok)
    prev_end = 0  # where the previous assistant turn's tokens end in the whole render
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _chat_ids(tok, messages[:i], generation_prompt=True, extra=extra) if i else _opening(tok, extra)
        start: int | None = len(prompt)
        moved: SampleRefused | None = None
        if full[: len(prompt)] != prompt:
            try:
                start = _start_in_whole(tok, messages, i, prompt, full, extra)
            except SampleRefused as e:  # the turn is then looked for by its own tokens, below
                start, moved = None, e
        upto = _chat_ids(tok, messages[: i + 1], generation_prompt=False, extra=extra)
        if upto[: len(prompt)] == prompt:
            base = len(prompt)
        elif start is not None and upto[:start] == full[:start]:
            base = start
        elif moved is not None:
            raise moved
        else:
            raise SampleRefused(
                f"message {i} (assistant): the chat template's generation prompt is not how it starts an "
                "assistant turn (the render with the turn does not extend the render of the prompt)"
            )
        if full[: len(upto)] != upto or len(upto) == len(full):
            # What the template writes after the final turn only (Phi-3's <|endoftext|>) is no part of the turn.
            upto = upto[: base + _turn_without_footer(tok, messages[: i + 1], upto, base, prompt, special, extra)]
        added = upto[base:]
        marks = [k for k, t in enumerate(added) if t in special]
        n = marks[-1] + 1 if marks else len(added)  # through the end-of-turn token, not the separator after
        same = _common(upto, full)
        if start is None:
            start = _find_once(full, added[:n], prev_end, special, i, moved)
        elif full[: len(upto)] != upto and same < base + n:
            # The turn renders differently with later turns (Qwen3 drops earlier reasoning; a template
            # ends its final turn with a stop token of its own): from where the two renders part, the
            # turn in the whole render ends after as many special tokens as the turn has from there.
            frm = max(same, base)
            count = sum(t in special for t in upto[frm : base + n])
            if not count:
                raise SampleRefused(
                    f"message {i} (assistant): the chat template renders this turn differently once later "
                    "turns follow, and ends it with no special token to find it by"
                )
            hits = [k for k in range(start + frm - base, len(full)) if full[k] in special][:count]
            if len(hits) < count:
                raise SampleRefused(f"message {i} (assistant): its end-of-turn token is missing from the whole render")
            n = hits[-1] + 1 - start
        if any(mask[start : start + n]):
            raise SampleRefused(f"message {i} (assistant): its tokens overlap the previous assistant turn's")
        mask[start : start + n] = [1] * n
        prev_end = start + n
    return full, mask


def _find_once(full: list[int], turn: list[int], after: int, special: set[int], i: int, moved: SampleRefused) -> int:
    """Where assistant turn ``i`` starts in the whole render when the template renders the
    conversation before it differently once later turns follow (Mistral v0.3 / Nemo move the
    system prompt to the last user turn, or drop it unless a user turn is last; tools go before
    the last user turn): its own tokens (content through its end-of-turn token, a special token)
    must occur exactly once after the previous assistant turn. Otherwise the sample is refused."""
    if not any(t in special for t in turn):
        raise moved
    hits = [k for k in range(after, len(full) - len(turn) + 1) if full[k] == turn[0] and full[k : k + len(turn)] == turn]
    if len(hits) != 1:
        raise SampleRefused(
            f"message {i} (assistant): the chat template renders the conversation before this turn differently "
            f"once later turns follow, and the turn's own tokens occur {len(hits)} times after the previous "
            "assistant turn in the whole render (not once), so they cannot be told apart; refused rather than "
            "trained with a wrong mask"
        )
    return hits[0]


def _turn_without_footer(tok: Any, messages: list[dict], upto: list[int], base: int, prompt: list[int],
                         special: set[int], extra: dict) -> int:  # fmt: skip
    """How many of the tokens from ``base`` on in ``upto`` (the render of ``messages``, ending with an
    assistant turn) are the turn's, without a conversation-level footer: what the template writes
    after the final turn only when no generation prompt follows (Phi-3 / Phi-3.5 write
    ``<|endoftext|>`` there). The footer is what the render has where the render with the
    generation prompt (the same messages, so the same turns) parts from it. It is dropped only
    when that render goes on with just the generation prompt (``prompt``, the turn's own, ends
    with it) and the turn's part before it ends with a special token and at most whitespace (its
    own end-of-turn token and separator). Otherwise what differs is the turn's end itself (a
    template that ends the final turn with a stop token of its own, as gpt-oss's ``<|return|>``)
    and it stays."""
    keep = len(upto) - base
    try:
        cont = _chat_ids(tok, messages, generation_prompt=True, extra=extra)
    except SampleRefused:
        return keep
    cut = _common(upto, cont)
    tail = len(cont) - cut  # what the generation prompt writes instead of the footer
    if not base <= cut < len(upto) or tail > len(prompt) or prompt[len(prompt) - tail :] != cont[cut:]:
        return keep
    marks = [k for k in range(base, cut) if upto[k] in special]
    if marks and not tok.decode(upto[marks[-1] + 1 : cut], skip_special_tokens=False).strip():
        return cut - base
    return keep


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _start_in_whole(tok: Any, messages: list[dict], i: int, prompt: list[int], full: list[int], extra: dict) -> int:
    """Where assistant turn ``i`` starts in the whole render when the prompt before it (with the
    generation prompt) is no prefix of it. Allowed only where the difference lies inside the
    generation prompt: Qwen3 with ``enable_thinking=False`` prompts with an empty
    ``<think></think>`` block that earlier turns in the history do not show. The turn then starts
    where the prompt and the whole render part, after the header they share."""
    before = _chat_ids(tok, messages[:i], generation_prompt=False, extra=extra) if i else []
    before = before[: _common(before, prompt)]  # without a footer written only where no generation prompt follows
    common = _common(prompt, full)
    if i and len(prompt) > len(before) and full[: len(before)] == before and common >= len(before):
        return common
    raise SampleRefused(
        f"message {i} (assistant): the chat template renders the conversation before this turn "
        "differently once later turns follow, so its tokens cannot be told apart; refused rather "
        "than trained with a wrong mask"
    )


def _opening(tok: Any, extra: dict | None = None) -> list[int]:
    """What the template writes before a conversation that opens with the assistant (BOS,
    generation prompt), or nothing where it cannot render an empty conversation."""
    try:
        return _chat_ids(tok, [], generation_prompt=True, extra=extra)
    except SampleRefused:
        return []


def _marked_mask(tok: Any, messages: list[dict], *, extra: dict | None = None) -> tuple[list[int], list[int]]:
    out = _apply(tok, messages, generation_prompt=False, tokenize=True, return_dict=True,
                 return_assistant_tokens_mask=True, **(extra or {}))  # fmt: skip
    ids = list(out["input_ids"])
    return ids, [int(x) for x in (out.get("assistant_masks") or [0] * len(ids))]


def _chat_ids(tok: Any, messages: list[dict], *, generation_prompt: bool, extra: dict | None = None) -> list[int]:
    """The template's text encoded as vLLM does for chat: no special tokens added on top."""
    text = _apply(tok, messages, generation_prompt=generation_prompt, tokenize=False, **(extra or {}))
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _apply(tok: Any, messages: list[dict], *, generation_prompt: bool, **kw: Any) -> Any:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kw)
    except Exception as e:  # the template's own raise_exception(), or a template bug
        raise SampleRefused(f"the chat template refused the conversation: {e}") from e


def _template(tok: Any, chat_template: str | None = None) -> str:
    """The template that renders: the job's own (a literal, or the name of one of the
    tokenizer's templates, as transformers resolves it), else the tokenizer's default."""
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):  # several named templates: the default one renders
        t = t.get(chat_template, chat_template) if chat_template is not None else t.get("default", "")
    elif chat_template is not None:
        t = chat_template
    if not t:
        raise SampleRefused("the verifier's tokenizer has no chat template: send prompt or token_ids")
    return t


def content_format(template: str) -> str:
    """``"openai"`` when the template loops over a message's content parts, else ``"string"``:
    vLLM's detection (vllm/renderers/hf.py ``_detect_content_format``), ported."""
    return _content_format(template)


@functools.lru_cache(maxsize=32)
def _content_format(template: str) -> str:
    import jinja2
    from jinja2 import nodes

    try:
        root = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _generation_ext()]).parse(template)
    except Exception:  # noqa: BLE001 - vLLM's default for a template it cannot parse
        return "string"

    def var(n: Any, name: str) -> bool:
        return isinstance(n, nodes.Name) and n.ctx == "load" and n.name == name

    def attr(n: Any, name: str, key: str) -> bool:
        if isinstance(n, nodes.Getitem):
            return var(n.node, name) and isinstance(n.arg, nodes.Const) and n.arg.value == key
        return isinstance(n, nodes.Getattr) and var(n.node, name) and n.attr == key

    def access(n: Any, name: str, key: str | None = None) -> bool:
        if isinstance(n, (nodes.Filter, nodes.Test)):
            return n.node is not None and access(n.node, name, key)
        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Slice):
            return access(n.node, name, key)
        return attr(n, name, key) if key else var(n, name)

    names, queue = ["messages"], ["messages"]  # variables bound to the messages (loop_messages = messages[1:])
    while queue:
        cur = queue.pop(0)
        for a in root.find_all(nodes.Assign):
            if isinstance(a.target, nodes.Name) and access(a.node, cur):
                names.append(a.target.name)
                if a.target.name != cur:
                    queue.append(a.target.name)
    items = [lp.target.name for lp in root.find_all(nodes.For)  # {% for message in messages %}
             if isinstance(lp.target, nodes.Name) and any(access(lp.iter, v) for v in names)]  # fmt: skip
    params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for mac in root.find_all(nodes.Macro):
        argn = {a.name for a in mac.args}
        got: set[str] = set()
        for call in root.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == mac.name:
                for k, a in enumerate(call.args):
                    if k < len(mac.args) and any(access(a, v, "content") for v in items):
                        got.add(mac.args[k].name)
                for kw in call.kwargs:
                    if kw.key in argn and any(access(kw.value, v, "content") for v in items):
                        got.add(kw.key)
        for lp in mac.find_all(nodes.For):
            in_macros.add(id(lp))
            if got:
                params[id(lp)] = got
    for lp in root.find_all(nodes.For):
        it = lp.iter
        if any(access(it, v, "content") for v in items):
            return "openai"
        if isinstance(it, nodes.Name) and (it.name in params.get(id(lp), ()) or
                                           (id(lp) not in in_macros and it.name == "content")):  # fmt: skip
            return "openai"
    return "string"


def _generation_ext() -> Any:
    import jinja2.ext
    from jinja2 import nodes

    class Generation(jinja2.ext.Extension):
        """Parses ``{% generation %}`` blocks (transformers' marker), so detection sees inside them."""

        tags = {"generation"}  # noqa: RUF012

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return Generation


def _special_ids(tok: Any) -> set[int]:
    ids = set(tok.all_special_ids)
    ids.update(i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return ids
