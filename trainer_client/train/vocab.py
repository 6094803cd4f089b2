"""Token counts and the draft vocabulary maps (d2t / t2d) built from them.

The maps must exist before step 1 (they decide which rows of the verifier's lm_head the draft
predicts over), yet the hidden states arrive only as training goes. So counts come from
somewhere that is known up front: the sidecar (``GET /v1/jobs/{id}/token_counts``, once it
exists), a file, or the samples the trainer submits itself, tokenised here with the
verifier's tokenizer the same way the sidecar does. Each source is one small function so
that switching source changes one call.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def count_tokens(token_ids: Iterable[list[int]], loss_masks: Iterable[list[int] | None] | None = None) -> dict[int, int]:
    """Counts of the tokens that carry loss (all tokens where no mask is given).

    Only loss-carrying tokens count, as in speculators: they are what the draft will be
    asked to predict.
    """
    c: Counter[int] = Counter()
    masks = loss_masks if loss_masks is not None else itertools.repeat(None)
    for ids, mask in zip(token_ids, masks):
        if mask is None:
            c.update(ids)
        else:
            if len(mask) != len(ids):
                raise ValueError(f"loss mask has {len(mask)} entries for {len(ids)} tokens")
            c.update(t for t, m in zip(ids, mask) if m)
    return dict(c)


def token_counts_from_file(path: str | Path) -> dict[int, int]:
    """Counts from JSON (``{"123": 45, ...}`` or ``{"counts": {...}}``) or a torch-saved dict."""
    p = Path(path)
    if p.suffix in (".pt", ".pth"):
        raw = torch.load(p, weights_only=True)
    else:
        raw = json.loads(p.read_text())
    if isinstance(raw, dict) and "counts" in raw and isinstance(raw["counts"], dict):
        raw = raw["counts"]
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{p}: expected a non-empty mapping token id -> count")
    try:
        return {int(k): int(v) for k, v in raw.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{p}: token ids and counts must be integers ({e})") from e


def save_token_counts(counts: dict[int, int], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"counts": {str(k): v for k, v in sorted(counts.items())}}) + "\n")


def token_counts_from_sidecar(api: str, job_ids: list[str], token: str | None = None) -> dict[int, int] | None:
    """Counts from the sidecar's ``GET /v1/jobs/{id}/token_counts``; None while it has no such endpoint."""
    from connector.contract.rest_client import SidecarClient, SidecarError

    total: Counter[int] = Counter()
    with SidecarClient(api, token=token, timeout=30) as c:
        for job in job_ids:
            try:
                total.update(c.token_counts(job).counts)
            except SidecarError as e:
                if e.status in (404, 405):
                    return None
                raise
    return dict(total)


def iter_tokenized(
    verifier_dir: str, samples: Iterable[dict], loss_mask: str = "assistant", mode: str = "extract",
    *, chat_template: str | None = None, chat_template_kwargs: dict | None = None,
) -> Iterator[tuple[list[int], list[int]]]:  # fmt: skip
    """(token ids, loss mask) per REST sample, one at a time, computed by the code the sidecar
    runs (``connector/contract/sample_tokens.py``). Samples the sidecar refuses (no assistant
    tokens, a template that cannot be masked, ...) are left out, as a job with
    ``on_invalid="skip"`` leaves them out; with ``"reject"`` the sidecar refused the whole job
    already. ``chat_template`` / ``chat_template_kwargs``: the job's options of those names.
    """
    from connector.contract.sample_tokens import SampleRefused, encode_sample, load_tokenizer

    tok = None
    for i, s in enumerate(samples):
        if tok is None and s.get("token_ids") is None:
            tok = load_tokenizer(verifier_dir)
        try:
            yield encode_sample(tok, s, loss_mask=loss_mask, mode=mode, chat_template=chat_template,
                                chat_template_kwargs=chat_template_kwargs)  # fmt: skip
        except SampleRefused as e:
            log.info("token counts leave out sample %d (%s): %s", i, s.get("id"), e)


def tokenize_samples(
    verifier_dir: str, samples: Iterable[dict], loss_mask: str = "assistant", mode: str = "extract",
    *, chat_template: str | None = None, chat_template_kwargs: dict | None = None,
) -> list[tuple[list[int], list[int]]]:  # fmt: skip
    """:func:`iter_tokenized` as a list (a few samples; counts stream through the iterator)."""
    return list(iter_tokenized(verifier_dir, samples, loss_mask, mode, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs))  # fmt: skip


def token_counts_from_samples(
    verifier_dir: str, samples: Iterable[dict], loss_mask: str = "assistant", **job: Any
) -> dict[int, int]:
    """Token counts of the loss-masked positions (the data's own replies: extract mode), a sample
    at a time, so a whole dataset is never held; ``job``: chat_template, chat_template_kwargs."""
    c: Counter[int] = Counter()
    for ids, mask in iter_tokenized(verifier_dir, samples, loss_mask, **job):
        c.update(count_tokens([ids], [mask]))
    return dict(c)


def build_vocab_maps(
    counts: dict[int, int] | None, draft_vocab_size: int, verifier_vocab_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d2t, t2d) for a draft vocabulary of the most frequent tokens; (None, None) for the full one.

    d2t holds offsets (target id = draft index + d2t[index]), t2d a boolean mask over the
    verifier's vocabulary: speculators' and vLLM's convention. Ties are broken by token id,
    so the same counts always give the same maps.
    """
    if draft_vocab_size >= verifier_vocab_size:
        return None, None
    if not counts:
        raise ValueError(
            f"a draft vocabulary of {draft_vocab_size} < {verifier_vocab_size} tokens needs token counts "
            "(--token-counts FILE, the samples submitted by the trainer, or the sidecar's token_counts endpoint)"
        )
    bad = [t for t in counts if not 0 <= t < verifier_vocab_size]
    if bad:
        raise ValueError(f"token counts name ids outside the verifier's vocabulary: {bad[:5]}")
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(dict(counts), draft_vocab_size, verifier_vocab_size)
    return d2t, t2d


def coverage(counts: dict[int, int], t2d: torch.Tensor | None) -> float:
    """Share of the counted tokens that the draft vocabulary can predict."""
    total = sum(counts.values())
    if t2d is None or total == 0:
        return 1.0
    return sum(v for k, v in counts.items() if bool(t2d[k])) / total
