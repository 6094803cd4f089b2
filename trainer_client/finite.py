"""Whether a tensor holds a NaN or an infinity, exactly and fast: non-finite floats are the
ones whose exponent bits are all ones, so the test is an integer AND and a max over the raw
words (each payload codec names its mask, ``PayloadCodec.finite_bits``), instead of
``torch.isfinite``, which converts every value to float first.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from connector.contract import payload as PL
from trainer_client.sample_reader import shared_pool

_CHUNK = 1 << 18  # words per pass: the scratch stays in cache


def _exponent_max_ok(words: np.ndarray, mask: int) -> bool:
    scratch = np.empty(min(_CHUNK, words.size), dtype=words.dtype)
    for i in range(0, words.size, _CHUNK):
        part = words[i : i + _CHUNK]
        s = scratch[: part.size]
        np.bitwise_and(part, mask, out=s)
        if s.max() == mask:
            return False
    return True


def _codec(t: torch.Tensor) -> PL.PayloadCodec | None:
    """The payload codec of ``t``'s dtype (None: not a payload dtype)."""
    return PL.CODECS.get(str(t.dtype).removeprefix("torch."))


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device, True unless ``t`` holds a NaN or an infinity, queued
    on the current stream (no host sync): what a device checks. ``torch.isfinite`` where the
    dtype has a kernel; FP8 has none on CUDA (``NotImplementedError``), so an encoded payload is
    tested on its exponent bits, as the host's scan does."""
    codec = _codec(t)
    spec = codec.finite_bits if codec is not None and codec.encoded else None
    if spec is None:
        return torch.isfinite(t).all()
    itype, mask = spec
    return (t.reshape(-1).view(getattr(torch, itype)) & mask).ne(mask).all()


def all_finite(t: torch.Tensor, threads: int | None = None) -> bool:
    """True unless ``t`` holds a NaN or an infinity; exact, for any float dtype.

    CPU tensors of a payload dtype are checked on their bits (the codec's ``finite_bits``),
    split over ``threads`` threads (default: up to 8, numpy releases the GIL); others on their
    device (:func:`finite_flag`).
    """
    codec = _codec(t)
    spec = codec.finite_bits if codec is not None else None
    if spec is None or t.device.type != "cpu" or t.numel() == 0:
        return bool(finite_flag(t)) if t.is_floating_point() and t.numel() else True
    itype, mask = spec
    words = t.contiguous().view(-1).view(torch.uint8).numpy().view(np.dtype(itype))
    n = threads if threads is not None else min(8, os.cpu_count() or 1)
    if n <= 1 or words.size < 4 * _CHUNK:
        return _exponent_max_ok(words, mask)
    pool = shared_pool("finite", min(8, os.cpu_count() or 1))
    step = -(-words.size // n)
    parts = [words[i : i + step] for i in range(0, words.size, step)]
    return all(pool.map(_exponent_max_ok, parts, [mask] * len(parts)))
