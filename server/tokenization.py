"""Turn REST samples into token ids and loss masks with the verifier's own tokenizer.

vLLM then receives token ids, never text, so what is extracted is exactly what was
tokenised here and the loss mask lines up position for position. The ids and masks come from
``connector/contract/sample_tokens.py`` (shared with the trainer's local token counts); this module
adds what only the sidecar decides: the vocabulary check of raw token ids and the length limits.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field

from connector.contract.rest import JobOptions, SampleIn
from connector.contract.sample_tokens import SampleRefused, encode_sample, load_tokenizer
from server.model_shape import too_long_reason

__all__ = ["SampleRefused", "Tokenized", "Tokenizer"]
log = logging.getLogger("hsstream.sidecar")

@dataclass
class Tokenized:
    token_ids: list[int]
    loss_mask: list[int]
    label: str | None
    repairs: list[str] = field(default_factory=list)  # what a ShareGPT conversation's cleaning changed


def no_trained_token(ids: list[int], mask: list[int], cut_to: int | None = None) -> None:
    """Refuse an extract-mode sample that would teach nothing: a draft predicts token t+1 from
    position t, so position 0 is never a target, and a sample whose loss mask has no 1 after it
    (a conversation whose replies truncation cut off, ``cut_to`` its new length) would be trained
    with a loss of 0. Refused here, at admission, the reason counted in the job's ``skipped``.
    A one-token prompt or ``token_ids`` sample (all of it masked, as such samples are) is
    admitted as before: the trainer acknowledges it without a step (``BatchSource``)."""
    if any(mask[1:]) or (len(ids) < 2 and cut_to is None and all(mask)):
        return
    cut = f" left after truncation to {cut_to:,} tokens (the replies come later)" if cut_to is not None else ""
    raise SampleRefused(f"no trained token{cut}: the loss mask has no 1 after the first token, so a draft would "
                        "learn nothing from it (a loss of 0); skipped", reason="no trained token")  # fmt: skip


class Tokenizer:
    #: A job's own chat template renders each sample in a worker thread, for at most this long.
    render_timeout_s = 10.0
    #: Renders past their time keep running (Python cannot stop a thread): with this many still
    #: running, jobs with their own template are refused until they end.
    max_stuck_renders = 2

    def __init__(self, model_dir: str | None, max_model_len: int | None = None) -> None:
        self._tok = None
        self._stuck: list[threading.Thread] = []
        self._slow: set[str] = set()  # digests of job templates that ran past their time
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.limit_source = "the model config's max_position_embeddings"
        self.vocab_size: int | None = None
        self._missing = "HSSTREAM_MODEL unset"
        if model_dir:
            try:
                self._tok = load_tokenizer(model_dir)
                self.vocab_size = len(self._tok)
            except (OSError, ValueError) as e:  # a hub id offline, a folder without tokenizer files
                self._missing = f"none could be loaded from {model_dir!r}: {str(e).splitlines()[0][:200]}"
                log.warning("no tokenizer (%s): only token_ids samples can be admitted", self._missing)

    def set_engine_limit(self, max_model_len: int) -> None:
        """vLLM answered: its max_model_len replaces the config's as the length limit."""
        self.max_model_len, self.limit_source = max_model_len, "vLLM's max_model_len"

    def __call__(self, s: SampleIn, opt: JobOptions) -> Tokenized:
        repairs: list[str] = []
        try:
            ids, mask = self._encode(s, opt, repairs)
        except SampleRefused:
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizer or chat template choked on this input
            raise SampleRefused(f"the tokenizer failed on this sample: {type(e).__name__}: {e}"[:500]) from e
        if not ids:
            raise SampleRefused("empty sample: no tokens")
        # vLLM needs room for what it generates beyond the prompt (1 token, or the new reply).
        room = opt.sampling.max_tokens if opt.mode == "regenerate" else 1
        limits = [(opt.max_tokens_per_sample, f"sample has {len(ids)} tokens, more than the limit of "
                   f"{opt.max_tokens_per_sample}")] if opt.max_tokens_per_sample else []  # fmt: skip
        if self.max_model_len:
            why = too_long_reason(len(ids), self.max_model_len, room, self.limit_source)
            limits.append((self.max_model_len - room, why))
        limit, why = min(limits) if limits else (None, "")
        cut_to = None
        if limit is not None and len(ids) > limit:
            if opt.overlong == "reject":
                raise SampleRefused(why)
            ids, mask, cut_to = ids[:limit], mask[:limit], limit
        if opt.mode == "extract":
            no_trained_token(ids, mask, cut_to)
        return Tokenized(ids, mask, s.id, repairs)

    def _encode(self, s: SampleIn, opt: JobOptions, notes: list[str] | None = None) -> tuple[list[int], list[int]]:
        if s.token_ids is not None:
            if self.vocab_size is not None:
                bad = [t for t in s.token_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise SampleRefused(f"token ids {bad[:5]} outside the vocabulary 0..{self.vocab_size - 1}")
        elif self._tok is None:
            raise SampleRefused(f"the sidecar has no tokenizer ({self._missing}): send token_ids")
        sample = s.model_dump(by_alias=True, exclude_none=True)
        kw = {"loss_mask": opt.loss_mask, "mode": opt.mode, "chat_template_kwargs": opt.chat_template_kwargs,
              "notes": notes}  # fmt: skip
        if opt.chat_template is None or s.token_ids is not None or (s.messages is None and s.conversations is None):
            return encode_sample(self._tok, sample, **kw)
        return self._bounded(sample, opt.chat_template, kw)

    def _bounded(self, sample: dict, template: str, kw: dict) -> tuple[list[int], list[int]]:
        """encode_sample with the job's own template, in a worker thread, for at most render_timeout_s."""
        digest = hashlib.sha256(template.encode()).hexdigest()
        if digest in self._slow:
            raise SampleRefused(f"the job's chat_template took longer than {self.render_timeout_s:g} s to render "
                                 "an earlier sample: refused")  # fmt: skip
        self._stuck = [t for t in self._stuck if t.is_alive()]
        if len(self._stuck) >= self.max_stuck_renders:
            raise SampleRefused(f"{len(self._stuck)} renders of earlier jobs' chat templates are still running past "
                                 "their time: jobs with their own chat_template are refused until they end")  # fmt: skip
        box: dict = {}

        def render() -> None:
            try:
                box["out"] = encode_sample(self._tok, sample, chat_template=template, **kw)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["err"] = e

        t = threading.Thread(target=render, name="hsstream-template", daemon=True)  # daemon: never holds up exit
        t.start()
        t.join(self.render_timeout_s)
        if t.is_alive():
            if len(self._slow) >= 256:
                self._slow.clear()
            self._slow.add(digest)
            self._stuck.append(t)
            log.warning("a job's chat template ran past %.1f s; its render thread is abandoned", self.render_timeout_s)
            raise SampleRefused(f"the job's chat_template took longer than {self.render_timeout_s:g} s to render "
                                 "this sample: refused (a template that loops without bound?)")
        if "err" in box:
            raise box["err"]
        return box["out"]
