"""The stream's per-sample checks made fast (issue 9): exponent-bit finiteness, the named
checksum kinds, the one-read loader for pinned buffers. Each check is shown to reject."""

from __future__ import annotations

import blake3
import pytest
import torch
import xxhash
from safetensors.torch import load_file

from connector import protocol as P
from trainer_client import finite as F
from trainer_client import stream as S

from tests.support import sample_files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("threads", [1, 4])
def test_all_finite_finds_every_kind_of_non_finite_anywhere(dtype, threads):
    x = (torch.randn(5 * F.CHUNK + 17) * 100).to(dtype)  # several chunks, a ragged tail
    assert S.all_finite(x, threads=threads)
    big = torch.full((5,), torch.finfo(dtype).max, dtype=dtype)  # largest finite: exponent not all ones
    assert S.all_finite(big, threads=threads) and S.all_finite(-big, threads=threads)
    for pos in (0, F.CHUNK - 1, F.CHUNK, 2 * F.CHUNK + 5, x.numel() - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[pos] = bad
            assert not S.all_finite(y, threads=threads), (pos, bad)
            assert S.all_finite(y, threads=threads) == bool(torch.isfinite(y).all())


def test_all_finite_on_views_and_other_dtypes():
    x = torch.randn(4, 6).to(torch.bfloat16)
    x[1, 5] = float("nan")
    assert S.all_finite(x[:, :5].t())  # non-contiguous view without the NaN
    assert not S.all_finite(x.t())
    assert S.all_finite(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert not S.all_finite(torch.tensor([1.0, float("inf")], dtype=torch.float64))
    assert S.all_finite(torch.arange(5))


def test_checksum_kinds_are_named_and_threads_do_not_change_the_digest():
    a, b = bytes(range(256)) * 1000, b"token ids"
    assert P.checksum(a, b, algo="blake3", threads=0) == P.checksum(a, b) == blake3.blake3(a + b).hexdigest()
    assert P.checksum(a, b, algo="xxh3-128") == xxhash.xxh3_128(a + b).hexdigest()
    assert P.checksum(a, b, algo="xxh3-128") != P.checksum(a, b, algo="blake3")
    assert set(P.CHECKSUM_ALGOS) == {"blake3", "xxh3-128"} and P.CHECKSUM_ALGO in P.CHECKSUM_ALGOS
    with pytest.raises(P.ProtocolError, match="unknown checksum algorithm 'md5'"):
        P.checksum(a, algo="md5")


def _write(spool, algo="blake3", corrupt=None, **notice_kw):  # noqa: ANN001, ANN003
    f = sample_files.write_sample(spool, "s.safetensors", tokens=6, layer_ids=[2, 4], num_hidden_layers=4, hidden=8,
                                  token_ids=torch.arange(10, 16), request_id="r", algo=algo,
                                  corrupt={"flip": "checksum"}.get(corrupt, corrupt), **notice_kw)  # fmt: skip
    return f.deliver, f.hidden_states, f.token_ids


@pytest.mark.parametrize("algo", ["blake3", "xxh3-128"])
def test_reader_verifies_whichever_checksum_the_notice_names(tmp_path, algo):
    d, hs, ids = _write(tmp_path, algo)
    smp = S.load_and_check(tmp_path, d)
    assert torch.equal(smp.hidden_states, hs) and torch.equal(smp.token_ids, ids)
    d, _, _ = _write(tmp_path, algo, corrupt="flip")
    with pytest.raises(S.InvalidSample, match="checksum mismatch"):
        S.load_and_check(tmp_path, d)


def test_reader_rejects_an_unknown_checksum_kind_and_non_finite_states(tmp_path):
    d, _, _ = _write(tmp_path, checksum_algo="crc7")
    with pytest.raises(S.InvalidSample, match="unknown checksum algorithm 'crc7'"):
        S.load_and_check(tmp_path, d)
    d, _, _ = _write(tmp_path, corrupt="nan")  # the checksum covers the NaN: finiteness is what fails
    with pytest.raises(S.InvalidSample, match="non-finite"):
        S.load_and_check(tmp_path, d)


def test_one_read_loader_equals_safetensors_and_refuses_bad_headers(tmp_path):
    d, hs, ids = _write(tmp_path)
    path = tmp_path / "s.safetensors"

    def alloc(n):  # noqa: ANN001, ANN202 - what the pinned path allocates, unpinned here (no CUDA)
        return torch.empty(n, dtype=torch.uint8)

    got = S.read_into_buffer(path, None, alloc)
    ref = load_file(str(path))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)
    assert got[P.HIDDEN_STATES_KEY].untyped_storage().data_ptr() == got[P.TOKEN_IDS_KEY].untyped_storage().data_ptr()
    from_bytes = S.read_into_buffer(None, path.read_bytes(), alloc)
    assert torch.equal(from_bytes[P.HIDDEN_STATES_KEY], hs)

    raw = path.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    with pytest.raises(S.InvalidSample, match="offsets"):  # truncated data
        S.read_into_buffer(None, raw[:-8], alloc)
    with pytest.raises(S.InvalidSample, match="header of"):
        S.read_into_buffer(None, (10**9).to_bytes(8, "little") + raw[8:], alloc)
    with pytest.raises(S.InvalidSample, match="unreadable safetensors header"):
        S.read_into_buffer(None, raw[:8] + b"{" * hlen + raw[8 + hlen :], alloc)
    with pytest.raises(S.InvalidSample, match="not safetensors"):
        S.read_into_buffer(None, b"abc", alloc)
