"""Token ids and loss masks of a REST sample: the one implementation the sidecar and the trainer share.

The sidecar tokenises every sample before vLLM sees it (vLLM gets token ids, never text), and a
trainer that counts tokens locally for its draft vocabulary must get the same ids and masks,
or its vocabulary is picked from other data than it trains on. So both import this module.
It lives in ``connector/`` next to the wire format and settings because that is the package
every role installs (the trainer installs without the server); like them it imports no
heavy library at import time: the tokenizer is a transformers object the caller passes in
(:func:`load_tokenizer` imports transformers lazily), so ``import trainer_client`` stays
free of transformers.

Token ids are what ``vllm serve`` would compute for the same text: a plain prompt is encoded
with the tokenizer's special tokens (``add_special_tokens=True``, e.g. Llama's BOS, as vLLM
does for a completion prompt); a conversation is rendered by the chat template and encoded
without adding any (the template writes its own BOS, as vLLM does for chat).

The assistant mask (which positions carry loss) works with every chat template:

* a template with ``{% generation %}`` markers: the marked characters (transformers'
  ``return_assistant_tokens_mask``), as the template's author meant;
* any other template: the conversation is rendered turn by turn. For assistant turn *i*, the
  render of the turns before it plus the generation prompt (exactly what the model would be
  prompted with) must be a token prefix of the whole conversation's render; the turn's
  tokens start there. They end after its end-of-turn token: the render up to and including
  the turn must also be a prefix, and its new tokens are kept through their last special
  token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>``), dropping the
  separator the template writes after it (ChatML's ``\\n``), which the model never
  generates. Templates that render a turn differently once later turns exist (Qwen3 drops
  the reasoning of earlier turns) make the second render no prefix; then the turn ends at
  the same end-of-turn token found in the whole render. When even the prompt before a turn
  is no prefix (a template that moves the system prompt to the last user turn), the sample
  is refused: no mask could be trusted.

So the generation-prompt header (``<|im_start|>assistant\\n``) never carries loss and the
end-of-turn token always does. A conversation with no assistant token at all is refused
rather than trained on with an all-zero mask.
"""

from __future__ import annotations

import re
from typing import Any

#: ShareGPT speakers → chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

#: How transformers recognises a template with generation markers (its own test, verbatim).
_MARKERS = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class SampleRefused(ValueError):
    """A sample that cannot become training data; the message says why, for the job's error list."""


def load_tokenizer(model: str) -> Any:
    """The verifier's tokenizer (a folder or hub id); imports transformers only when called."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def sample_messages(sample: dict) -> list[dict]:
    """The chat messages of a sample given as ``messages`` or ShareGPT ``conversations``."""
    if sample.get("messages") is not None:
        msgs = [dict(m) for m in sample["messages"]]
    else:
        msgs = []
        for t in sample.get("conversations") or []:
            role = SHAREGPT_ROLES.get(t.get("from"))
            if role is None:
                raise SampleRefused(f"unknown ShareGPT speaker {t.get('from')!r} (known: {', '.join(SHAREGPT_ROLES)})")
            msgs.append({"role": role, "content": t.get("value")})
    if not msgs:
        raise SampleRefused("empty conversation")
    return msgs


def encode_sample(tok: Any, sample: dict, *, loss_mask: str = "assistant", mode: str = "extract") -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one REST sample (a dict with ``prompt``, ``messages``,
    ``conversations`` or ``token_ids``); raises :class:`SampleRefused` with the reason.

    ``mode="regenerate"``: vLLM writes the reply, so the data's trailing assistant turns are
    dropped, the prompt ends with the generation prompt, and nothing of it carries loss.
    """
    train = 0 if mode == "regenerate" else 1
    if sample.get("token_ids") is not None:
        ids = list(sample["token_ids"])
        return ids, [train] * len(ids)
    if sample.get("prompt") is not None:
        if not sample["prompt"]:
            raise SampleRefused("empty prompt")
        ids = list(tok(sample["prompt"], add_special_tokens=True)["input_ids"])  # as vLLM encodes a prompt
        return ids, [train] * len(ids)
    msgs = sample_messages(sample)
    if mode == "regenerate":
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise SampleRefused("nothing left to prompt with after removing the assistant reply")
        ids = _chat_ids(tok, msgs, generation_prompt=True)
        return ids, [0] * len(ids)
    if loss_mask == "all":
        ids = _chat_ids(tok, msgs, generation_prompt=False)
        return ids, [1] * len(ids)
    return assistant_mask(tok, msgs)


def assistant_mask(tok: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, 1 on each assistant turn's tokens and its
    end-of-turn token, 0 elsewhere). See the module docstring for the method."""
    if _MARKERS.search(_template(tok)):
        ids, mask = _marked_mask(tok, messages)
    else:
        ids, mask = turn_by_turn_mask(tok, messages)
    if not any(mask):
        roles = ", ".join(sorted({m["role"] for m in messages}))
        raise SampleRefused(
            f"no assistant tokens to train on (roles in the conversation: {roles}): a loss mask of all "
            "zeros teaches nothing; send at least one assistant turn, or loss_mask='all'"
        )
    return ids, mask


def turn_by_turn_mask(tok: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The mask from incremental renders (no generation markers needed)."""
    full = _chat_ids(tok, messages, generation_prompt=False)
    mask = [0] * len(full)
    special = _special_ids(tok)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _chat_ids(tok, messages[:i], generation_prompt=True) if i else _opening(tok)
        if full[: len(prompt)] != prompt:
            raise SampleRefused(
                f"message {i} (assistant): the chat template renders the conversation before this turn "
                "differently once later turns follow, so its tokens cannot be told apart; refused rather "
                "than trained with a wrong mask"
            )
        upto = _chat_ids(tok, messages[: i + 1], generation_prompt=False)
        if upto[: len(prompt)] != prompt:
            raise SampleRefused(
                f"message {i} (assistant): the chat template's generation prompt is not how it starts an "
                "assistant turn (the render with the turn does not extend the render of the prompt)"
            )
        added = upto[len(prompt) :]
        marks = [k for k, t in enumerate(added) if t in special]
        n = marks[-1] + 1 if marks else len(added)  # through the end-of-turn token, not the separator after
        if full[: len(upto)] != upto:
            # The turn renders differently with later turns (e.g. Qwen3 drops earlier reasoning):
            # it ends at the same count of its end-of-turn token in the whole render.
            if not marks:
                raise SampleRefused(
                    f"message {i} (assistant): the chat template renders this turn differently once later "
                    "turns follow, and ends it with no special token to find it by"
                )
            eot, count = added[marks[-1]], added[:n].count(added[marks[-1]])
            hits = [k for k in range(len(prompt), len(full)) if full[k] == eot][:count]
            if len(hits) < count:
                raise SampleRefused(f"message {i} (assistant): its end-of-turn token is missing from the whole render")
            n = hits[-1] + 1 - len(prompt)
        if any(mask[len(prompt) : len(prompt) + n]):
            raise SampleRefused(f"message {i} (assistant): its tokens overlap the previous assistant turn's")
        mask[len(prompt) : len(prompt) + n] = [1] * n
    return full, mask


def _opening(tok: Any) -> list[int]:
    """What the template writes before a conversation that opens with the assistant (BOS,
    generation prompt), or nothing where it cannot render an empty conversation."""
    try:
        return _chat_ids(tok, [], generation_prompt=True)
    except SampleRefused:
        return []


def _marked_mask(tok: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = _apply(tok, messages, generation_prompt=False, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = list(out["input_ids"])
    return ids, [int(x) for x in (out.get("assistant_masks") or [0] * len(ids))]


def _chat_ids(tok: Any, messages: list[dict], *, generation_prompt: bool) -> list[int]:
    """The template's text encoded as vLLM does for chat: no special tokens added on top."""
    text = _apply(tok, messages, generation_prompt=generation_prompt, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _apply(tok: Any, messages: list[dict], *, generation_prompt: bool, **kw: Any) -> Any:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kw)
    except Exception as e:  # the template's own raise_exception(), or a template bug
        raise SampleRefused(f"the chat template refused the conversation: {e}") from e


def _template(tok: Any) -> str:
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):  # several named templates: the default one renders
        t = t.get("default", "")
    if not t:
        raise SampleRefused("the verifier's tokenizer has no chat template: send prompt or token_ids")
    return t


def _special_ids(tok: Any) -> set[int]:
    ids = set(tok.all_special_ids)
    ids.update(i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return ids
