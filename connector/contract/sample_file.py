"""What a sample file holds: its tensors, its checksum and the bytes it covers, its size, and
the one parser of its header.

A sample file is a safetensors file: an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte span; our notice under ``__metadata__``), then the data.
It holds ``hidden_states`` [T, K, H] and ``token_ids`` [T] (the keys of vLLM's Example
connector, so its users read our files unchanged), plus whatever tensors the payload's codec
adds (``connector/contract/payload.py``, e.g. FP8's per-token scales). The connector writes it,
the sidecar prices it, the stream parses and checks it: all by this module. Importable without
torch; the one function that touches tensors imports it lazily.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from connector.contract.errors import ProtocolError

if TYPE_CHECKING:
    from connector.contract.messages import Notice

#: Keys inside the safetensors file.
HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"
#: safetensors header-metadata key holding the notice as JSON.
HEADER_NOTICE_KEY = "hsstream.notice"

#: Checksum kinds a file's notice may name (``Notice.checksum_algo``). The connector writes
#: the one configured (``HSSTREAM_CHECKSUM``), the reader verifies whichever the notice names.
#: ``CHECKSUM_ALGO`` (blake3) is what a notice without the field means, and these functions'
#: default: the wire format's, unchanged.
CHECKSUM_ALGOS = ("blake3", "xxh3-128")
CHECKSUM_ALGO = "blake3"
#: What the connector writes unless told otherwise (``HSSTREAM_CHECKSUM``): xxh3-128 (xxHash's
#: XXH3, 128 bits) on one thread. It is computed inside vLLM's worker, whose cores the engine
#: needs: on the H200 host xxh3-128 took 2.1 ms and 2.1 ms of CPU per 33.5 MB sample where
#: blake3 took 6.2 ms on one thread, 2.2 ms on four (7.5 ms of CPU), 0.8 ms on all 16 (9.3 ms of
#: CPU) (``bench/costs/checksum_cost.py``, docs/benchmarks.md). It has to catch torn or corrupted
#: bytes, not forged ones: the spool and the sockets are this user's or CURVE's; only bytes read
#: over Mooncake's unauthenticated TCP could be changed on the way, and there blake3 (its digest
#: arriving over CURVE) would also catch a deliberate change: set blake3 where Mooncake runs
#: over a network that is not trusted.
CONNECTOR_CHECKSUM_ALGO = "xxh3-128"

#: Upper bound of a file's safetensors header (tensor table + our notice as metadata).
HEADER_ALLOWANCE = 4096
#: The longest safetensors header a sample may have; anything longer is refused unparsed.
MAX_HEADER_BYTES = 1 << 20
#: safetensors names of the token ids' dtypes a file may hold, with their bytes per value (the
#: hidden states' come from the payload codecs).
TOKEN_ID_DTYPES: dict[str, int] = {"I64": 8, "I32": 4}


class InvalidSample(ValueError):
    """A sample file (or its delivery) that fails a check: reported failed and produced again."""


def checksum(*buffers: Any, algo: str = CHECKSUM_ALGO, threads: int = 1) -> str:
    """The named checksum over raw bytes, in the order :func:`checksum_buffers` gives.

    One definition for files on the spool and bytes sent over the network. Both kinds release
    the GIL on large inputs, so checking never stalls the engine or the training loop.
    ``threads`` (blake3 only; 0 = as many as useful) does not change the digest: the writer
    inside vLLM keeps one (``HSSTREAM_CHECKSUM_THREADS``: more threads shorten a sample's
    checksum but cost more CPU in all, taken from the engine), the trainer, which must keep up
    with a GPU, uses all.
    """
    h = new_hasher(algo, threads)
    for b in buffers:
        h.update(memoryview(b).cast("B"))
    return h.hexdigest()


def new_hasher(algo: str = CHECKSUM_ALGO, threads: int = 1) -> Any:  # noqa: ANN401 - blake3 or xxhash object
    """A streaming hasher of the named checksum (``update`` / ``hexdigest``): feeding it the
    buffers of :func:`checksum_buffers` in any pieces, in order, gives :func:`checksum`'s digest."""
    if algo == "blake3":
        import blake3

        return blake3.blake3(max_threads=blake3.blake3.AUTO if threads == 0 else max(1, threads))
    if algo == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128()
    raise ProtocolError(f"unknown checksum algorithm {algo!r} (known: {', '.join(CHECKSUM_ALGOS)})")


#: Checksums that hash on the calling thread alone (blake3 may use threads of its own): a reader
#: can scan each piece it has just hashed while it is in cache (``trainer_client.finite``).
ONE_THREAD_ALGOS = frozenset({"xxh3-128"})


def checksum_buffers(tensors: Mapping[str, Any]) -> list[Any]:
    """The byte buffers the checksum covers, in its order: the hidden states, then the payload's
    other tensors by name (FP8: its scales), then the token ids; each tensor's bytes as they
    lie in the file (little-endian, C order). One definition for the writer and every reader."""
    import torch

    def raw(t: Any) -> Any:
        return t.contiguous().view(torch.uint8).numpy()

    extra = sorted(k for k in tensors if k not in (HIDDEN_STATES_KEY, TOKEN_IDS_KEY))
    return [raw(tensors[HIDDEN_STATES_KEY]), *(raw(tensors[k]) for k in extra), raw(tensors[TOKEN_IDS_KEY])]


def sample_checksum(tensors: Mapping[str, Any], algo: str = CHECKSUM_ALGO, threads: int = 1) -> str:
    """The checksum a sample file's notice carries, over its tensors."""
    return checksum(*checksum_buffers(tensors), algo=algo, threads=threads)


def checksum_and_finite(tensors: Mapping[str, Any], algo: str = CHECKSUM_ALGO, threads: int = 1) -> tuple[str, bool | None]:
    """:func:`sample_checksum`'s digest and, where the checksum hashes on this thread alone
    (:data:`ONE_THREAD_ALGOS`) and the hidden states are contiguous host words of a payload
    codec, whether every value is finite, found in the same pass over the bytes
    (``finite_scan.ChunkedScan.hash_and_run``): the writer's verdict for the notice's
    ``finite``. Otherwise (digest, None): not looked at."""
    from connector.contract.finite_scan import scan_of_bytes

    hs = tensors[HIDDEN_STATES_KEY]
    if algo not in ONE_THREAD_ALGOS or hs.device.type != "cpu" or not hs.is_contiguous():
        return sample_checksum(tensors, algo=algo, threads=threads), None
    bufs = checksum_buffers(tensors)
    scan = scan_of_bytes(bufs[0], str(hs.dtype).removeprefix("torch."))
    if scan is None:
        return checksum(*bufs, algo=algo, threads=threads), None
    h = new_hasher(algo, threads)
    finite = scan.hash_and_run(h)  # the hidden states: the first of the buffers
    for b in bufs[1:]:
        h.update(memoryview(b).cast("B"))
    return h.hexdigest(), finite


def expected_nbytes(num_tokens: int, num_layers: int, hidden_size: int, dtype_size: int, scale_bytes: int = 0) -> int:
    """Bytes of a sample's hidden states (and their per-token scales, ``scale_bytes`` each, for a
    quantised payload): what the spool budget reserves before submitting."""
    return num_tokens * (num_layers * hidden_size * dtype_size + scale_bytes)


def expected_file_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype_size: int,
                        scale_bytes: int = 0) -> int:  # fmt: skip
    """Bytes a sample's file can take on the spool: what admission reserves before submitting,
    so the files that do arrive never exceed the budget."""
    return expected_nbytes(num_tokens, num_layers, hidden_size, dtype_size, scale_bytes) + 8 * num_tokens + HEADER_ALLOWANCE


def header_metadata(notice: Notice) -> dict[str, str]:
    """The safetensors metadata of a sample file: its notice as JSON."""
    return {HEADER_NOTICE_KEY: notice.model_dump_json(), "format": "pt"}


# -- the header ------------------------------------------------------------------------------


class TensorSpan(NamedTuple):
    """One tensor of a parsed header: safetensors dtype name, shape, byte span in the file."""

    dtype: str
    shape: list[int]
    start: int
    end: int


def header_length(first8: bytes, size: int) -> int:
    """The safetensors header's length from a file's first 8 bytes, refused past the file's end
    or past MAX_HEADER_BYTES (ours are a few kB: a longer one is not worth parsing)."""
    hlen = int.from_bytes(first8[:8], "little")
    if hlen > size - 8 or hlen > MAX_HEADER_BYTES:
        raise InvalidSample(f"safetensors header of {hlen} bytes in a {size}-byte file (at most {MAX_HEADER_BYTES})")
    return hlen


def parse_header(head: bytes, size: int, itemsizes: Mapping[str, int]) -> tuple[dict[str, TensorSpan], dict[str, str]]:
    """The tensors the header at the start of ``head`` (the file's first bytes, header included)
    describes, with their byte spans in the file, and the header's metadata.

    The header is input from another process and every malformed one is an
    :class:`InvalidSample` (refused, produced again), never another exception, which would stop
    the trainer at each redelivery of the sample. The rules are safetensors' own (it reads the
    same files when unpinned), so both readers refuse the same headers. Each entry is
    ``{"dtype": <a name in itemsizes>, "shape": [ints >= 0], "data_offsets": [start, end]}``
    (other fields ignored) whose bytes match its shape and whose data is aligned to its item
    size; the entries tile the data section exactly, no overlap and no gap; ``__metadata__`` is
    null or a map of strings."""
    hlen = header_length(bytes(head[:8]), size)
    try:
        header = json.loads(bytes(head[8 : 8 + hlen]))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past Python's stack
        raise InvalidSample(f"unreadable safetensors header: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise InvalidSample("unreadable safetensors header: not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise InvalidSample("safetensors header: __metadata__ is not a map of strings")
    base = 8 + hlen
    spans: dict[str, TensorSpan] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, start, end = _entry(name, entry, size - base, itemsizes)
        itemsize = itemsizes[dtype]
        if end - start != math.prod(shape) * itemsize:
            raise InvalidSample(f"tensor {name!r}: offsets {start}..{end} do not fit its shape {shape}")
        if (base + start) % itemsize:
            # Never with safetensors' own writer (it aligns); the header is all we have read.
            raise InvalidSample(f"tensor {name!r}: data at offset {base + start}, not aligned to {itemsize} bytes")
        spans[name] = TensorSpan(dtype, shape, base + start, base + end)
    at = base
    for name, sp in sorted(spans.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if sp.start != at:
            raise InvalidSample(f"tensor {name!r}: offsets {sp.start - base}..{sp.end - base} "
                                f"{'overlap the tensor before' if sp.start < at else 'leave a gap after the tensor before'}")  # fmt: skip
        at = sp.end
    if at != size:
        raise InvalidSample(f"safetensors data: the tensors' offsets cover {at - base} of its {size - base} bytes")
    return spans, dict(meta or {})


def _entry(name: str, entry: object, data_bytes: int, itemsizes: Mapping[str, int]) -> tuple[str, list[int], int, int]:
    """One tensor's (dtype, shape, start, end), checked, or :class:`InvalidSample`. Values are
    shown abridged (``reprlib``): a full repr of a deeply nested value would recurse as deep."""
    if not isinstance(entry, dict):
        raise InvalidSample(f"tensor {name!r}: bad header entry {reprlib.repr(entry)}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in itemsizes:
        raise InvalidSample(f"tensor {name!r}: dtype {reprlib.repr(dtype)} is not one a sample holds")

    def count(x: object) -> bool:  # a JSON integer (not a bool) that can be a size in this file
        return type(x) is int and 0 <= x <= data_bytes

    if not isinstance(shape, list) or len(shape) > 8 or not all(count(x) for x in shape):
        raise InvalidSample(f"tensor {name!r}: shape {reprlib.repr(shape)} is not a list of sizes in this file")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(count(x) for x in offsets) or offsets[0] > offsets[1]:
        raise InvalidSample(f"tensor {name!r}: data_offsets {reprlib.repr(offsets)} do not fit the file's "
                            f"{data_bytes} data bytes")  # fmt: skip
    return dtype, shape, offsets[0], offsets[1]
