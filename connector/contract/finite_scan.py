"""Whether a sample's stored hidden states hold a NaN or an infinity, exactly, on their raw
words: one definition for the writer, which says so in the notice, and for every reader.

Non-finite floats are the ones whose exponent bits are all ones (each payload codec names its
mask, ``PayloadCodec.finite_bits``). Every codec's mask is the top run of the bits below the
sign (the exponent; e4m3fn's NaN is exponent and mantissa all ones), so a word is non-finite
exactly when, sign aside, it is at least the mask: a positive one makes the words' signed
maximum reach the mask, a negative one their unsigned maximum reach sign | mask. Two maxima
per chunk, the second over a chunk the first brought into cache, read the bytes once and write
nothing (a mask of another shape falls back to AND and max).

A scan is cut into chunks (:class:`ChunkedScan`): hashed and scanned chunk by chunk on one
thread (:meth:`ChunkedScan.hash_and_run`, the writer's way: the bytes come from memory once),
or taken by any number of threads from either end (:meth:`ChunkedScan.run`, the trainer's
beside its checksum). numpy only: this module is imported where torch is not.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

import numpy as np

#: Words per chunk: 512 KB of 2-byte words stays in a core's cache for the second pass.
CHUNK = 1 << 18


@lru_cache(maxsize=None)
def _max_rule(itype: str, mask: int) -> tuple[np.dtype, np.dtype, int, int] | None:
    """(signed view, unsigned view, the signed maximum's limit, the unsigned one's) for a mask
    that is the top run of the non-sign bits; None for another mask."""
    bits = np.dtype(itype).itemsize * 8
    top = (1 << (bits - 1)) - 1
    if mask <= 0 or mask & ~top or (top ^ mask) >= (mask & -mask):
        return None
    return np.dtype(f"int{bits}"), np.dtype(f"uint{bits}"), mask, (1 << (bits - 1)) | mask


def words_ok(words: np.ndarray, mask: int, lo: int = 0, hi: int | None = None) -> bool:
    """No non-finite word in ``words[lo:hi]`` (``mask``: the codec's exponent bits)."""
    hi = words.size if hi is None else hi
    rule = _max_rule(words.dtype.name, mask)
    if rule is not None:
        sdt, udt, pos, neg = rule
        s, u = words.view(sdt), words.view(udt)
        for i in range(lo, hi, CHUNK):
            j = min(i + CHUNK, hi)
            if s[i:j].max() >= pos or u[i:j].max() >= neg:
                return False
        return True
    scratch = np.empty(min(CHUNK, max(1, hi - lo)), dtype=words.dtype)
    for i in range(lo, hi, CHUNK):
        part = words[i : min(i + CHUNK, hi)]
        s = scratch[: part.size]
        np.bitwise_and(part, mask, out=s)
        if s.max() == mask:
            return False
    return True


def scan_of_bytes(raw: Any, dtype: str) -> ChunkedScan | None:  # noqa: ANN401 - any C-contiguous buffer
    """The :class:`ChunkedScan` of a stored tensor's raw bytes (``raw``, C order, as
    ``sample_file.checksum_buffers`` gives them) of payload dtype ``dtype``; None for a dtype
    without a finiteness mask."""
    from connector.contract import payload as PL

    codec = PL.CODECS.get(dtype)
    if codec is None or codec.finite_bits is None:
        return None
    itype, mask = codec.finite_bits
    return ChunkedScan(np.asarray(raw).reshape(-1).view(np.uint8).view(np.dtype(itype)), mask)


class ChunkedScan:
    """The finiteness scan of ``words`` (a flat array of one codec's words, ``mask`` its
    exponent bits), in chunks of ``chunk`` words; the first non-finite chunk stops every taker.
    Each chunk is scanned once: ``scanned`` counts them (tests check none is missed or repeated)."""

    def __init__(self, words: np.ndarray, mask: int, chunk: int = CHUNK) -> None:
        if words.ndim != 1 or not words.flags.c_contiguous:
            raise TypeError("a chunked scan needs a flat contiguous array of words")
        self.words, self.mask, self.chunk = words, mask, chunk
        self._lo, self._hi = 0, -(-words.size // chunk)
        self._lock = threading.Lock()
        self.bad = False
        self._stopped = False
        self.scanned = 0

    def _take(self, front: bool) -> int | None:
        with self._lock:
            if self.bad or self._stopped or self._lo >= self._hi:
                return None
            self.scanned += 1
            if front:
                self._lo += 1
                return self._lo - 1
            self._hi -= 1
            return self._hi

    def run(self, front: bool = True) -> bool:
        """Scan chunks until none is left (or one is bad); True unless a non-finite was found."""
        while (i := self._take(front)) is not None:
            a = i * self.chunk
            if not words_ok(self.words, self.mask, a, min(a + self.chunk, self.words.size)):
                self.bad = True
        return not self.bad

    def hash_and_run(self, hasher: Any) -> bool:  # noqa: ANN401 - any object with update()
        """Hash the words' bytes into ``hasher`` chunk by chunk, each chunk scanned right after
        it is hashed, while it is in cache: one pass over memory on one thread (a scan on another
        thread beside the hash reads every byte from memory a second time). Takes every chunk;
        True unless a non-finite was found."""
        with self._lock:
            todo, self._lo = range(self._lo, self._hi), self._hi
            self.scanned += len(todo)
        raw, isz = self.words.view(np.uint8), self.words.itemsize
        for i in todo:
            a, b = i * self.chunk, min((i + 1) * self.chunk, self.words.size)
            hasher.update(raw[a * isz : b * isz])
            if not self.bad and not words_ok(self.words, self.mask, a, b):
                self.bad = True  # the hash goes on: the digest covers every byte
        return not self.bad

    def stop(self) -> None:
        """No chunk is taken after this (the sample was refused for another reason)."""
        self._stopped = True

    @property
    def ok(self) -> bool:
        """No non-finite value found; True only once every chunk was taken (and, after the
        takers are done, scanned)."""
        return not self.bad and not self._stopped and self._lo >= self._hi
