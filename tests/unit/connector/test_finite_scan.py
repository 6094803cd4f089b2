"""The one finiteness test on raw words (``connector/contract/finite_scan.py``) that the writer's
verdict and every reader's scan share: exact against ``torch.isfinite`` for every payload codec
and both signs, wherever the value lies in its chunk; every chunk taken exactly once however
many threads share a scan; the writer's hashed pass gives the checksum's digest."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from connector.contract import payload as PL
from connector.contract import sample_file as SF
from connector.contract.finite_scan import CHUNK, ChunkedScan, _max_rule, words_ok


def _words(t: torch.Tensor) -> tuple[np.ndarray, int]:
    itype, mask = PL.CODECS[str(t.dtype).removeprefix("torch.")].finite_bits
    return t.reshape(-1).view(torch.uint8).numpy().view(np.dtype(itype)), mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_words_ok_is_isfinite_for_every_codec_and_sign(dtype):
    x = (torch.randn(2 * CHUNK + 5) * 10).to(dtype)
    w, mask = _words(x)
    assert _max_rule(w.dtype.name, mask) is not None  # every codec's mask takes the two-maxima path
    assert words_ok(w, mask)
    big = torch.full((7,), torch.finfo(dtype).max, dtype=dtype)  # largest finite: not all ones
    assert words_ok(*_words(big)) and words_ok(*_words((-big.float()).to(dtype)))
    bads = [float("nan"), -float("nan")] + ([] if dtype == torch.float8_e4m3fn else [float("inf"), -float("inf")])
    for pos in (0, CHUNK - 1, CHUNK, x.numel() - 1):
        for bad in bads:
            y = x.clone()
            y[pos] = bad
            assert not words_ok(*_words(y)), (pos, bad)
            assert words_ok(*_words(y)) == bool(torch.isfinite(y.float()).all())


def test_a_mask_of_another_shape_falls_back_to_and_and_max():
    w = np.array([0x0F0F, 0x00F0, 0x7000], dtype=np.uint16)
    assert _max_rule("uint16", 0x0F00) is None
    assert words_ok(w, 0x0F00) is False and words_ok(w[1:], 0x0F00) is True


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_every_chunk_is_taken_once_from_either_end(threads):
    x = torch.randn(7 * 1024 + 3, dtype=torch.bfloat16)
    w, mask = _words(x)
    for bad in (None, 0, 1023, 1024, 7 * 1024 + 2):
        y = x.clone()
        if bad is not None:
            y[bad] = float("nan")
        s = ChunkedScan(_words(y)[0], mask, chunk=1024)
        ts = [threading.Thread(target=s.run, args=(i % 2 == 0,)) for i in range(threads)]
        for t in ts:
            t.start()
        s.run(front=False)
        for t in ts:
            t.join()
        if bad is None:
            assert s.ok and s.scanned == 8
        else:
            assert not s.ok and s.scanned <= 8


@pytest.mark.parametrize("where", [None, 0, CHUNK, 3 * CHUNK - 1, 3 * CHUNK + 63])
def test_the_writers_pass_gives_the_checksums_digest_and_the_verdict(where):
    hs = torch.randn(3 * CHUNK // 64 + 1, 1, 64, dtype=torch.bfloat16)  # a ragged last chunk
    if where is not None:
        hs.view(-1)[where] = float("inf")
    t = {SF.HIDDEN_STATES_KEY: hs, SF.TOKEN_IDS_KEY: torch.arange(hs.shape[0])}
    digest, finite = SF.checksum_and_finite(t, algo="xxh3-128")
    assert digest == SF.sample_checksum(t, algo="xxh3-128")
    assert finite is (where is None)
    assert SF.checksum_and_finite(t, algo="blake3") == (SF.sample_checksum(t, algo="blake3"), None)
    assert SF.checksum_and_finite({**t, SF.HIDDEN_STATES_KEY: hs.transpose(0, 2)}, algo="xxh3-128")[1] is None
