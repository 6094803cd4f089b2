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


def all_finite(t: torch.Tensor, threads: int | None = None) -> bool:
    """True unless ``t`` holds a NaN or an infinity; exact, for any float dtype.

    CPU tensors of a payload dtype are checked on their bits (the codec's ``finite_bits``),
    split over ``threads`` threads (default: up to 8, numpy releases the GIL); others fall back
    to ``torch.isfinite``.
    """
    codec = PL.CODECS.get(str(t.dtype).removeprefix("torch."))
    spec = codec.finite_bits if codec is not None else None
    if spec is None or t.device.type != "cpu" or t.numel() == 0:
        return bool(torch.isfinite(t).all()) if t.is_floating_point() else True
    itype, mask = spec
    words = t.contiguous().view(-1).view(torch.uint8).numpy().view(np.dtype(itype))
    n = threads if threads is not None else min(8, os.cpu_count() or 1)
    if n <= 1 or words.size < 4 * _CHUNK:
        return _exponent_max_ok(words, mask)
    pool = shared_pool("finite", min(8, os.cpu_count() or 1))
    step = -(-words.size // n)
    parts = [words[i : i + step] for i in range(0, words.size, step)]
    return all(pool.map(_exponent_max_ok, parts, [mask] * len(parts)))
