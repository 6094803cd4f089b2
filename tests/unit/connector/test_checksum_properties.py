"""The sample checksum, as properties: what the writer computes over a sample's parts is the
library's own digest of their concatenated bytes, whatever the thread count, and it changes
with any corruption a file can suffer (a flipped bit, parts out of order, a short file).

The writer may pick either kind (``HSSTREAM_CHECKSUM``) and thread count
(``HSSTREAM_CHECKSUM_THREADS``) and the reader recomputes with its own (blake3 on all cores):
both agree only if neither changes the digest. The checksum covers the byte stream, not where
the parts end (the header fixes each tensor's span, and the shapes are checked apart), so
reordering parts changes the digest exactly when it changes the bytes.
"""

from __future__ import annotations

import random

import blake3
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.contract import sample_file as SF

np = pytest.importorskip("numpy")

ALGOS = SF.CHECKSUM_ALGOS
REFERENCE = {
    "blake3": lambda data: blake3.blake3(data).hexdigest(),
    "xxh3-128": xxhash.xxh3_128_hexdigest,
}
#: blake3's thread pool only splits inputs past a few chunks of 1 KiB; xxh3 ignores ``threads``.
THREADS = (0, 1, 2, 4)

# Part sizes around the hashes' own boundaries (blake3: 64-byte blocks, 1 KiB chunks; xxh3:
# 16/128/240-byte paths, 64-byte stripes, 1 KiB blocks) and large enough for blake3's threads.
_size = st.one_of(st.integers(0, 300), st.integers(900, 2_200), st.integers(100_000, 600_000))
_parts = st.tuples(st.integers(0, 2**32 - 1), st.lists(_size, min_size=1, max_size=6))


def _bytes(seed: int, sizes: list[int]) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def _as_buffers(parts: list[bytes]) -> list[object]:
    """The parts in the shapes the writer hands over: numpy arrays (checksum_buffers' uint8,
    and wider dtypes, which it casts to bytes), bytes and bytearrays."""
    out: list[object] = []
    for i, p in enumerate(parts):
        kind = i % 4
        if kind == 0:
            out.append(np.frombuffer(p, dtype=np.uint8))
        elif kind == 1 and len(p) % 8 == 0:
            out.append(np.frombuffer(p, dtype=np.int64))
        elif kind == 2:
            out.append(bytearray(p))
        else:
            out.append(p)
    return out


def _split_like(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` cut at the same boundaries as parts of ``sizes`` (the last one takes the rest)."""
    out, at = [], 0
    for n in sizes[:-1]:
        out.append(data[at : at + n])
        at += n
    return [*out, data[at:]]


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=40, deadline=None)
@given(case=_parts)
def test_checksum_over_parts_is_the_librarys_digest_of_their_concatenation(algo, case):
    parts = _bytes(*case)
    ref = REFERENCE[algo](b"".join(parts))
    for threads in THREADS:
        assert SF.checksum(*_as_buffers(parts), algo=algo, threads=threads) == ref, f"threads={threads}"


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=40, deadline=None)
@given(case=_parts, where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7),
       threads=st.sampled_from(THREADS))  # fmt: skip
def test_any_single_bit_flip_changes_the_digest(algo, case, where, bit, threads):
    seed, sizes = case
    parts = _bytes(seed, sizes)
    data = bytearray(b"".join(parts))
    if not data:
        return
    good = SF.checksum(*parts, algo=algo, threads=threads)
    data[int(where * len(data))] ^= 1 << bit
    assert SF.checksum(*_split_like(bytes(data), sizes), algo=algo, threads=threads) != good


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=40, deadline=None)
@given(case=_parts, pick=st.tuples(st.integers(0, 5), st.integers(0, 5)), threads=st.sampled_from(THREADS))
def test_swapping_two_parts_changes_the_digest_when_it_changes_the_bytes(algo, case, pick, threads):
    parts = _bytes(*case)
    i, j = (p % len(parts) for p in pick)
    swapped = list(parts)
    swapped[i], swapped[j] = parts[j], parts[i]
    same_bytes = b"".join(swapped) == b"".join(parts)
    same_digest = SF.checksum(*swapped, algo=algo, threads=threads) == SF.checksum(*parts, algo=algo, threads=threads)
    assert same_digest == same_bytes
    if parts[i] != parts[j] and len(parts[i]) == len(parts[j]):  # two tensors of one size: bytes differ
        assert not same_digest


@pytest.mark.parametrize("algo", ALGOS)
def test_swapping_two_unequal_parts_of_a_sample_changes_the_digest(algo):
    """The concrete case: two distinct tensors of the same size written in each other's place."""
    a, b, c = _bytes(7, [4096, 4096, 64])
    assert SF.checksum(a, b, c, algo=algo) != SF.checksum(b, a, c, algo=algo)


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=40, deadline=None)
@given(case=_parts, cut=st.integers(1, 2_000), threads=st.sampled_from(THREADS))
def test_truncation_by_one_byte_or_more_changes_the_digest(algo, case, cut, threads):
    seed, sizes = case
    parts = _bytes(seed, sizes)
    data = b"".join(parts)
    if not data:
        return
    good = SF.checksum(*parts, algo=algo, threads=threads)
    short = data[: max(0, len(data) - cut)]
    assert SF.checksum(*_split_like(short, sizes), algo=algo, threads=threads) != good
    if parts[-1]:  # and a last part (the token ids) shorter, the others intact
        assert SF.checksum(*parts[:-1], parts[-1][:-1], algo=algo, threads=threads) != good


# -- over a sample's real tensors, as the writer builds them -------------------------------

torch = pytest.importorskip("torch")
from connector.contract import payload as PL  # noqa: E402


def _sample(dtype: str, seed: int, tokens: int = 24, layers: int = 3, hidden: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(tokens, layers, hidden, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, 151_000, (tokens,), generator=g, dtype=torch.int64)
    return {**PL.codec(dtype).encode(hs), SF.TOKEN_IDS_KEY: ids}


SAMPLE_DTYPES = ("bfloat16", PL.FP8_DTYPE)  # bf16 as the model's own; FP8 e4m3 with per-token scales


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", SAMPLE_DTYPES)
def test_sample_checksum_covers_the_tensors_in_checksum_buffers_order(algo, dtype):
    """The digest is of the bytes as the file lays them out: hidden states, the codec's extra
    tensors by name (FP8: the scales), token ids; each tensor little-endian, C order."""
    t = _sample(dtype, seed=1)
    names = [SF.HIDDEN_STATES_KEY, *sorted(set(t) - {SF.HIDDEN_STATES_KEY, SF.TOKEN_IDS_KEY}), SF.TOKEN_IDS_KEY]
    assert set(t) == PL.codec(dtype).tensor_names()
    assert (PL.SCALES_KEY in names) == (dtype == PL.FP8_DTYPE)
    raw = b"".join(t[k].contiguous().view(torch.uint8).numpy().tobytes() for k in names)
    for threads in THREADS:
        assert SF.sample_checksum(t, algo=algo, threads=threads) == REFERENCE[algo](raw)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", SAMPLE_DTYPES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_sample_checksum_detects_a_flipped_bit_in_each_tensor(algo, dtype, seed, where, bit):
    t = _sample(dtype, seed)
    good = SF.sample_checksum(t, algo=algo)
    for name in t:
        bad = {k: v.clone() for k, v in t.items()}
        raw = bad[name].reshape(-1).view(torch.uint8)
        raw[int(where * raw.numel())] ^= 1 << bit
        assert SF.sample_checksum(bad, algo=algo) != good, f"a flipped bit in {name!r} went unseen"


# -- the connector's setting ---------------------------------------------------------------


def test_the_connector_writes_xxh3_on_one_thread_unless_told_otherwise(monkeypatch):
    """The default is measured (bench/costs/checksum_cost.py, docs/benchmarks.md); the wire format's
    default (a notice without ``checksum_algo``) stays blake3."""
    from connector.contract import messages as M
    from connector.contract.settings import Settings

    for k in ("HSSTREAM_CHECKSUM", "HSSTREAM_CHECKSUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    s = Settings()
    assert (s.checksum, s.checksum_threads) == ("xxh3-128", 1) == (SF.CONNECTOR_CHECKSUM_ALGO, 1)
    assert SF.CHECKSUM_ALGO == "blake3" and M.Notice.model_fields["checksum_algo"].default == "blake3"
    monkeypatch.setenv("HSSTREAM_CHECKSUM", "blake3")
    monkeypatch.setenv("HSSTREAM_CHECKSUM_THREADS", "0")
    assert (Settings().checksum, Settings().checksum_threads) == ("blake3", 0)
    monkeypatch.setenv("HSSTREAM_CHECKSUM_THREADS", "-1")
    with pytest.raises(ValueError, match="checksum_threads"):
        Settings()
