"""Turn REST samples into token ids and loss masks with the verifier's own tokenizer.

vLLM then receives token ids, never text, so what is extracted is exactly what was
tokenised here and the loss mask lines up position for position.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.schemas import JobOptions, SampleIn

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class SampleRejected(ValueError):
    pass


@dataclass
class Tokenized:
    token_ids: list[int]
    loss_mask: list[int]
    label: str | None


class Tokenizer:
    def __init__(self, model_dir: str | None, max_model_len: int | None = None) -> None:
        self._tok = None
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.vocab_size: int | None = None
        if model_dir:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(model_dir)
            self.vocab_size = len(self._tok)

    def __call__(self, s: SampleIn, opt: JobOptions) -> Tokenized:
        try:
            ids, mask = self._encode(s, opt)
        except SampleRejected:
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizer or chat template choked on this input
            raise SampleRejected(f"the tokenizer failed on this sample: {type(e).__name__}: {e}"[:500]) from e
        if not ids:
            raise SampleRejected("empty sample: no tokens")
        # vLLM needs room for what it generates beyond the prompt (1 token, or the new reply).
        room = opt.sampling.max_tokens if opt.mode == "regenerate" else 1
        limits = [x for x in (opt.max_tokens_per_sample, self.max_model_len and self.max_model_len - room) if x]
        limit = min(limits) if limits else None
        if limit is not None and len(ids) > limit:
            if opt.overlong == "reject":
                raise SampleRejected(f"sample has {len(ids)} tokens, more than the limit of {limit}")
            ids, mask = ids[:limit], mask[:limit]
        return Tokenized(ids, mask, s.id)

    def _need(self) -> object:
        if self._tok is None:
            raise SampleRejected("the sidecar has no tokenizer (HSSTREAM_MODEL unset): send token_ids")
        return self._tok

    def _encode(self, s: SampleIn, opt: JobOptions) -> tuple[list[int], list[int]]:
        if s.token_ids is not None:
            if self.vocab_size is not None:
                bad = [t for t in s.token_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise SampleRejected(f"token ids {bad[:5]} outside the vocabulary 0..{self.vocab_size - 1}")
            return list(s.token_ids), [0 if opt.mode == "regenerate" else 1] * len(s.token_ids)
        tok = self._need()
        if s.prompt is not None:
            if not s.prompt:
                raise SampleRejected("empty prompt")
            ids = tok(s.prompt, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
            return ids, [0 if opt.mode == "regenerate" else 1] * len(ids)
        if s.messages is not None:
            msgs = [m.model_dump() for m in s.messages]
        else:
            assert s.conversations is not None
            msgs = []
            for t in s.conversations:
                role = _SHAREGPT_ROLES.get(t.from_)
                if role is None:
                    raise SampleRejected(f"unknown ShareGPT speaker {t.from_!r}")
                msgs.append({"role": role, "content": t.value})
        if not msgs:
            raise SampleRejected("empty conversation")
        if opt.mode == "regenerate":
            # vLLM writes the reply: drop the data's last assistant turn, ask for a new one.
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            if not msgs:
                raise SampleRejected("nothing left to prompt with after removing the assistant reply")
            ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)
            ids = list(ids["input_ids"])
            return ids, [0] * len(ids)
        out = tok.apply_chat_template(  # type: ignore[attr-defined]
            msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = list(out["input_ids"])
        amask = list(out.get("assistant_masks") or [0] * len(ids))
        mask = amask if opt.loss_mask == "assistant" else [1] * len(ids)
        return ids, [int(x) for x in mask]
