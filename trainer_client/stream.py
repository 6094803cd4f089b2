"""``HiddenStateStream``: what a training loop iterates over.

The loop should not think about files, sockets or acknowledgements. The stream asks the
sidecar for samples with credit (never more in flight than it can hold), validates each
sample before yielding it (a bad one is reported failed and regenerated, never yielded),
deletes the spool file as soon as the tensors are in memory (the spool is the producer's
budget), and acknowledges at use or when the loop says so (``ack_through``), so samples used
after the last checkpoint come back after a crash. Only the iterating thread touches the
socket; a burst of deliveries is read and checked by a few workers (``check_pool.py``) whose
results come back to it, as they finish (or in delivery order: ``ordered``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import reprlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq
import zmq.auth
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

from connector import endpoints as E
from connector import payload as PL
from connector import protocol as P
from connector.curve_keys import load_secret
from connector.settings import Settings, lower_switch_interval
from connector.transport import Receiver, TransportError, make_receiver
from trainer_client.check_pool import CheckPool
from trainer_client.host_buffers import HostBuffers

log = logging.getLogger("hsstream.trainer")


class StreamError(RuntimeError):
    pass


class InvalidSample(ValueError):
    pass


@dataclass
class Sample:
    key: P.SampleKey | None  # None: a file read directly (a plain vLLM request, no sidecar)
    token_ids: torch.Tensor  # [T] int64
    hidden_states: torch.Tensor  # [T, K, H] in the file's layer order
    layer_ids: list[int]
    num_hidden_layers: int
    loss_mask: torch.Tensor | None = None  # [T] bool
    label: str | None = None
    notice: P.Notice | None = field(default=None, repr=False)
    #: float32 [T, 1, 1] while ``hidden_states`` is still FP8 (``connector/payload.py``); None
    #: for an unquantised payload and once dequantised.
    scales: torch.Tensor | None = field(default=None, repr=False)
    #: Where this sample's time went in the stream (see :meth:`HiddenStateStream.__iter__`):
    #: wall-clock stamps (``received``, ``started``, ``checked``, ``handed``; ``time.time()``,
    #: the clock of ``notice.sent_at``) and phase durations in seconds (``alloc_s``, ``read_s``,
    #: ``checksum_s``, ``finite_s``, ``to_device_s``).
    timings: dict[str, float] = field(default_factory=dict, repr=False)

    def dequantized(self, dtype: torch.dtype | None) -> Sample:
        """This sample with FP8 hidden states turned into ``dtype`` (x = fp8 × its token's scale);
        unchanged if it is not quantised or ``dtype`` is None (the trainer dequantises itself)."""
        if self.scales is None or dtype is None:
            return self
        from dataclasses import replace

        return replace(self, hidden_states=PL.dequantize(self.hidden_states, self.scales, dtype), scales=None)

    @property
    def aux_hidden_states(self) -> torch.Tensor:
        """The layers below N ([T, K', H]): the draft's input features."""
        idx = [i for i, lid in enumerate(self.layer_ids) if lid != self.num_hidden_layers]
        return self.hidden_states[:, idx]

    @property
    def last_hidden_state(self) -> torch.Tensor | None:
        """Layer N, the pre-norm final state ([T, H]) the targets come from; None if absent."""
        if self.num_hidden_layers not in self.layer_ids:
            return None
        return self.hidden_states[:, self.layer_ids.index(self.num_hidden_layers)]


#: safetensors dtype names of the tensors a sample file may hold.
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
              "I32": torch.int32, "F8_E4M3": torch.float8_e4m3fn}  # fmt: skip


def read_sample_file(path: Path | None = None, payload: bytes | memoryview | None = None, *,
                     pin_memory: bool = False, alloc: Callable[[int], torch.Tensor] | None = None,
                     timings: dict[str, float] | None = None, on_header: OnHeader | None = None) -> dict:  # fmt: skip
    """A sample file's tensors (from the spool, or the bytes a remote sidecar sent).

    Unpinned, safetensors maps the file: no copy at all, the checks read the pages in place.
    Pinned (the trainer copies to a GPU): the file goes straight into one page-locked buffer
    with one read — safetensors has no way to read into a caller's buffer, and pinning its
    tensors afterwards would copy the 33.5 MB of a Qwen3-8B-shape sample once more; torch's
    pinned allocator hands the same buffers back sample after sample, so they are not faulted
    in again each time (a fresh 33.5 MB buffer costs ~20 ms of page faults alone).
    ``alloc``: where the pinned buffer comes from (``host_buffers.HostBuffers.alloc``).
    ``on_header``: see :func:`read_into_buffer` (unpinned, it sees the whole file at once).
    """
    if not pin_memory:
        if isinstance(payload, memoryview):  # a transport's reused buffer: copy out once, views of it
            return read_into_buffer(None, payload, lambda n: torch.empty(n, dtype=torch.uint8), timings, on_header)
        try:
            if payload is not None:
                _header_length(np.frombuffer(payload[:8], dtype=np.uint8), len(payload))  # its limit is ours
                out = safetensors_load(payload)
            else:
                with open(path, "rb") as f:  # type: ignore[arg-type]
                    _header_length(np.frombuffer(f.read(8), dtype=np.uint8), os.fstat(f.fileno()).st_size)
                with safe_open(str(path), framework="pt") as f:
                    out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except (OSError, InvalidSample):
            raise  # the file is missing or cannot be opened: not its bytes' fault (see _settle)
        except Exception as e:  # noqa: BLE001 - any parse failure (SafetensorError, ...) is an invalid sample
            raise InvalidSample(f"unreadable safetensors: {e}") from e
        if on_header is not None and (feed := on_header(out, None)) is not None:
            feed(0, 0)
        return out
    alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    return read_into_buffer(path, payload, alloc, timings, on_header)


#: Called once a file's header is read, before its data: ``(tensors, spans)`` — the tensors
#: (views of the buffer, not filled yet) and each one's byte span in it, or None when the
#: tensors are complete already — returns None or ``feed(a, b)``, told in file order as bytes
#: [a, b) of the buffer arrive (all of them, last call ending at the file's size; ``(0, 0)``:
#: all at once). A sample's header is checked there before its data is read, and its copy to
#: a GPU starts part by part while later parts are still being read. (The checksum waits for
#: the whole: blake3 fed 2 MB at a time ran on one core, 7 ms per sample against 0.8 ms for
#: one call on all cores, docs/benchmarks.md.)
OnHeader = Callable[[dict, "dict[str, tuple[int, int]] | None"], "Callable[[int, int], None] | None"]

#: A file is read in parts of this many bytes, on up to READ_THREADS threads at once
#: (``HSSTREAM_READ_THREADS``), taken in file order. One thread read tmpfs at 3-5 GB/s on the
#: H200 host (8.3 ms for a 33.5 MB sample, most of the notice-to-GPU floor); the kernel's copy
#: scales with threads (4.7 ms with 2, 2.7 with 4, 1.6 with 8). Parts smaller than a thread's
#: share let the first ones be copied to the GPU while the rest are read (docs/benchmarks.md).
READ_PART = 2 << 20


def _read_threads(env: str | None) -> int:
    """``HSSTREAM_READ_THREADS``: a positive integer (default 8), at most the CPU count."""
    try:
        n = int(env) if env is not None and env.strip() else 8
        if n < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"HSSTREAM_READ_THREADS must be a positive integer (threads reading one file), "
                         f"got {env!r}") from None  # fmt: skip
    return min(n, os.cpu_count() or 1)


READ_THREADS = _read_threads(os.environ.get("HSSTREAM_READ_THREADS"))
#: Bytes read first, for the header (safetensors' header of a sample is < HEADER_ALLOWANCE).
HEAD_BYTES = 64 << 10
#: The longest safetensors header a sample may have; anything longer is refused unparsed.
MAX_HEADER_BYTES = 1 << 20
_shared: dict[str, ThreadPoolExecutor] = {}  # module-wide helper pools, made on first use
_shared_lock = threading.Lock()  # the stream's check workers may all ask for one at once


def _pread_into(fd: int, mv: memoryview, offset: int) -> int:
    """Fill ``mv`` from ``offset``; fewer bytes only at the end of the file."""
    done = 0
    while done < len(mv):
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def _shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The module's pool ``hsstream-<name>`` (the file readers, the finiteness scan)."""
    with _shared_lock:
        if name not in _shared:
            _shared[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"hsstream-{name}")
        return _shared[name]


def read_parallel(fd: int, mv: memoryview, size: int, threads: int | None = None, *, start: int = 0,
                  feed: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
    """Read bytes [start, size) of ``fd`` into ``mv`` (same offsets) in parts of READ_PART,
    ``threads`` at once (``os.preadv`` releases the GIL), parts taken in file order. With a
    ``feed`` the calling thread only hands it every part that has arrived, in file order, as
    soon as it has (a part it read itself would wait behind its own read); without, it reads
    too. Raises :class:`InvalidSample` on a short read (the file is shorter than it was when its
    size was taken). Returns only when no reader touches ``mv`` any more."""
    n = threads if threads is not None else READ_THREADS
    parts = [(a, min(a + READ_PART, size)) for a in range(start, size, READ_PART)]
    n = max(1, min(n, len(parts)))
    got = [-1] * len(parts)
    arrived = [threading.Event() for _ in parts]
    lock = threading.Lock()
    nxt = [0]

    def take() -> bool:
        with lock:
            i = nxt[0]
            if i >= len(parts):
                return False
            nxt[0] += 1
        a, b = parts[i]
        try:
            got[i] = _pread_into(fd, mv[a:b], a)
        finally:
            arrived[i].set()
        return True

    def reader() -> None:
        while take():
            pass

    pool = _shared_pool("read", 2 * READ_THREADS)
    helpers = [pool.submit(reader) for _ in range(n if feed is not None else n - 1)]
    fed, short = 0, False
    try:
        while fed < len(parts):
            if feed is None:
                take()  # one more part ourselves (nothing if all are taken)
            while fed < len(parts) and arrived[fed].is_set():
                if got[fed] != parts[fed][1] - parts[fed][0]:
                    short = True
                    break
                if feed is not None:
                    feed(*parts[fed])
                fed += 1
            if short:
                break
            if fed < len(parts) and (feed is not None or nxt[0] >= len(parts)):
                arrived[fed].wait()
    finally:
        with lock:
            nxt[0] = len(parts)  # on an error: the helpers take nothing more ...
        futures.wait(helpers)  # ... and the buffer (and fd) is given back only once none reads into it,
        for h in helpers:  # even if one of them failed (its error is raised here)
            h.result()
    if short:
        raise InvalidSample(f"short read: {start + sum(max(g, 0) for g in got)} of {size} bytes")


def read_into_buffer(path: Path | None, payload: bytes | memoryview | None, alloc,  # noqa: ANN001
                     timings: dict[str, float] | None = None, on_header: OnHeader | None = None) -> dict:  # fmt: skip
    """safetensors' layout (8-byte little-endian header length, JSON header, data) read into
    ``alloc(size)``; the tensors are views of it at the header's offsets, which are checked.
    A file's header is read first, then its data in parts (:func:`read_parallel`), handed to
    ``on_header``'s feed as they arrive. ``timings`` gets ``alloc_s`` (the buffer) and
    ``read_s`` (the bytes into it, with the feed's work between the parts)."""
    if payload is not None:
        size = len(payload)
    else:
        assert path is not None
        size = os.stat(path).st_size
    if size < 8:
        raise InvalidSample(f"{size}-byte file: not safetensors")
    t0 = time.perf_counter()
    buf = alloc(size)
    t1 = time.perf_counter()
    view = buf.numpy()
    if payload is not None:
        view[:] = np.frombuffer(payload, dtype=np.uint8)
        tensors, spans = _tensors_in(buf, view, size)
        if on_header is not None and (feed := on_header(tensors, spans)) is not None:
            feed(0, size)
    else:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # type: ignore[arg-type]
        try:
            mv = memoryview(view)
            head = min(size, HEAD_BYTES)
            if _pread_into(fd, mv[:head], 0) != head:
                raise InvalidSample(f"short read: the file is shorter than its {size} bytes")
            hlen = _header_length(view, size)
            if head < 8 + hlen:  # a long header: the rest of it before the data
                head = 8 + hlen
                if _pread_into(fd, mv[HEAD_BYTES:head], HEAD_BYTES) != head - HEAD_BYTES:
                    raise InvalidSample(f"short read: the file is shorter than its {size} bytes")
            tensors, spans = _tensors_in(buf, view, size)
            feed = on_header(tensors, spans) if on_header is not None else None
            if feed is not None:
                feed(0, head)
            read_parallel(fd, mv, size, start=head, feed=feed)
        finally:
            os.close(fd)
    if timings is not None:
        timings["alloc_s"], timings["read_s"] = t1 - t0, time.perf_counter() - t1
    return tensors


def _header_length(view: np.ndarray, size: int) -> int:
    """The safetensors header's length from its first 8 bytes, refused past the file's end or
    past MAX_HEADER_BYTES (ours are a few kB: a longer one is not worth parsing)."""
    hlen = int.from_bytes(view[:8].tobytes(), "little")
    if hlen > size - 8 or hlen > MAX_HEADER_BYTES:
        raise InvalidSample(f"safetensors header of {hlen} bytes in a {size}-byte file (at most {MAX_HEADER_BYTES})")
    return hlen


def _tensors_in(buf: torch.Tensor, view: np.ndarray, size: int) -> tuple[dict, dict[str, tuple[int, int]]]:
    """The tensors the header at the start of ``buf`` describes (views of it) and their byte spans.

    The header is input from another process and every malformed one is an
    :class:`InvalidSample` (refused, produced again), never another exception, which would stop
    the trainer at each redelivery of the sample: the rules are safetensors' own (it reads the
    same files when unpinned), so both readers refuse the same headers. Each entry is
    ``{"dtype": <a known name>, "shape": [ints >= 0], "data_offsets": [start, end]}`` (other
    fields ignored) whose bytes match its shape; the entries tile the data section exactly, no
    overlap and no gap; ``__metadata__`` is null or a map of strings."""
    hlen = _header_length(view, size)
    try:
        header = json.loads(view[8 : 8 + hlen].tobytes())
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past Python's stack
        raise InvalidSample(f"unreadable safetensors header: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise InvalidSample("unreadable safetensors header: not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise InvalidSample("safetensors header: __metadata__ is not a map of strings")
    base = 8 + hlen
    out, spans = {}, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, start, end = _entry(name, entry, size - base)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if end - start != math.prod(shape) * itemsize:
            raise InvalidSample(f"tensor {name!r}: offsets {start}..{end} do not fit its shape {shape}")
        if (base + start) % itemsize:
            # Never with safetensors' own writer (it aligns); the header is all we have read.
            raise InvalidSample(f"tensor {name!r}: data at offset {base + start}, not aligned to {itemsize} bytes")
        spans[name] = (base + start, base + end)
    at = base
    for name, (a, b) in sorted(spans.items(), key=lambda kv: kv[1]):
        if a != at:
            raise InvalidSample(f"tensor {name!r}: offsets {a - base}..{b - base} "
                                f"{'overlap the tensor before' if a < at else 'leave a gap after the tensor before'}")  # fmt: skip
        at = b
    if at != size:
        raise InvalidSample(f"safetensors data: the tensors' offsets cover {at - base} of its {size - base} bytes")
    for name, (a, b) in spans.items():
        dtype, shape = _ST_DTYPES[header[name]["dtype"]], header[name]["shape"]
        out[name] = buf[a:b].view(dtype).view(shape)
    return out, spans


def _entry(name: str, entry: object, data_bytes: int) -> tuple[torch.dtype, list[int], int, int]:
    """One tensor's (dtype, shape, start, end), checked, or :class:`InvalidSample`. Values are
    shown abridged (``reprlib``): a full repr of a deeply nested value would recurse as deep."""
    if not isinstance(entry, dict):
        raise InvalidSample(f"tensor {name!r}: bad header entry {reprlib.repr(entry)}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise InvalidSample(f"tensor {name!r}: dtype {reprlib.repr(dtype)} is not one a sample holds")

    def count(x: object) -> bool:  # a JSON integer (not a bool) that can be a size in this file
        return type(x) is int and 0 <= x <= data_bytes

    if not isinstance(shape, list) or len(shape) > 8 or not all(count(x) for x in shape):
        raise InvalidSample(f"tensor {name!r}: shape {reprlib.repr(shape)} is not a list of sizes in this file")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(count(x) for x in offsets) or offsets[0] > offsets[1]:
        raise InvalidSample(f"tensor {name!r}: data_offsets {reprlib.repr(offsets)} do not fit the file's "
                            f"{data_bytes} data bytes")  # fmt: skip
    return _ST_DTYPES[dtype], shape, offsets[0], offsets[1]


#: Non-finite floats are the ones whose exponent bits are all ones: test the bits (an integer
#: AND and a max over the raw words) instead of ``torch.isfinite``, which converts every bf16
#: to float first (122 ms for a 33.5 MB sample on one core; this takes a few ms).
_EXPONENT = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000),
             torch.float8_e4m3fn: (torch.uint8, 0x7F)}  # fmt: skip  # e4m3fn: no inf, NaN is S.1111.111
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

    CPU float tensors are checked on their bits, split over ``threads`` threads (default: up
    to 8, numpy releases the GIL); others fall back to ``torch.isfinite``.
    """
    spec = _EXPONENT.get(t.dtype)
    if spec is None or t.device.type != "cpu" or t.numel() == 0:
        return bool(torch.isfinite(t).all()) if t.is_floating_point() else True
    itype, mask = spec
    words = t.contiguous().view(itype).numpy().reshape(-1)
    n = threads if threads is not None else min(8, os.cpu_count() or 1)
    if n <= 1 or words.size < 4 * _CHUNK:
        return _exponent_max_ok(words, mask)
    pool = _shared_pool("finite", min(8, os.cpu_count() or 1))
    step = -(-words.size // n)
    parts = [words[i : i + step] for i in range(0, words.size, step)]
    return all(pool.map(_exponent_max_ok, parts, [mask] * len(parts)))


def load_and_check(spool: Path | None, d: P.Deliver, payload: bytes | memoryview | None = None, *, require_key: bool = True,
                   pin_memory: bool = False, checksum_threads: int = 0, device: torch.device | str | None = None,
                   alloc: Callable[[int], torch.Tensor] | None = None,
                   timings: dict[str, float] | None = None) -> Sample:  # fmt: skip
    """Read a delivered sample (from the spool, or from the bytes a remote trainer received)
    and check it against its notice and what the sidecar submitted. ``require_key=False``:
    a file from a plain vLLM request (no sample key), see :func:`read_hidden_states`.

    ``pin_memory``: the tensors live in page-locked memory, ready for a non-blocking copy to
    a GPU (``alloc`` gives the buffer). ``checksum_threads`` (0: all useful) does not change
    the digest. Safe to call from several threads at once (the stream's check workers).

    ``device`` (the trainer's): the hidden states (and FP8 scales) are copied there and their
    finiteness is checked there; the sample is returned with them on that device. None or a CPU
    device: checked on the host, as always. On a CUDA device each part of the hidden states is
    copied as soon as it is read (:class:`_SampleChecks`), so the copy overlaps the read, and
    the finiteness check there overlaps the host's checksum; a sample refused later has its
    device copy dropped, never returned. ``timings`` receives each phase's seconds.
    """
    tm = timings if timings is not None else {}
    n = d.notice
    if n.file is None or (require_key and n.key is None):
        raise InvalidSample("delivery without a file or key")
    if n.checksum_algo not in P.CHECKSUM_ALGOS:
        raise InvalidSample(f"unknown checksum algorithm {n.checksum_algo!r}")
    if n.dtype not in P.DTYPE_SIZES:
        raise InvalidSample(f"unknown payload dtype {n.dtype!r} in the notice")
    dev = torch.device(device) if device is not None else None
    checks = _SampleChecks(n, dev, checksum_threads, tm)
    if payload is not None:
        tensors = read_sample_file(payload=payload, pin_memory=pin_memory, alloc=alloc, timings=tm, on_header=checks.start)
    else:
        if spool is None:
            raise InvalidSample("delivery without bytes, and no spool to read from")
        t0 = time.perf_counter()
        tensors = read_sample_file(P.resolve_in_spool(spool, n.file), pin_memory=pin_memory, alloc=alloc, timings=tm,
                                   on_header=checks.start)  # fmt: skip
        tm.setdefault("read_s", time.perf_counter() - t0)  # unpinned: safetensors maps the file
    hs, ids, scales = checks.host_checks(tensors)
    if d.expected_token_ids is not None and ids.tolist() != d.expected_token_ids:
        raise InvalidSample("token ids differ from the ones submitted")
    mask = torch.tensor(d.loss_mask, dtype=torch.bool) if d.loss_mask is not None else None
    if mask is not None and mask.shape[0] != n.num_tokens:
        raise InvalidSample(f"loss mask has {mask.shape[0]} entries for {n.num_tokens} tokens")
    if checks.copy is not None:
        hs, scales = checks.copy.finish()
    elif dev is not None and dev.type != "cpu":
        hs, scales = to_device_checked(hs, scales, dev, tm)
    return Sample(n.key, ids, hs, list(n.layer_ids), n.num_hidden_layers, mask, d.label, n, scales)


class _SampleChecks:
    """One sample's checks against its notice, run as its file arrives: the header's tensors,
    shapes and dtype before any data is read (:meth:`start`), then on a CUDA device each part of
    the hidden states copied there as it arrives (:meth:`_feed`); the rest once the file is in
    (:meth:`host_checks`)."""

    def __init__(self, n: P.Notice, dev: torch.device | None, threads: int, tm: dict[str, float]) -> None:
        self.n, self.dev, self.tm, self.threads = n, dev, tm, threads
        self.copy: DeviceCopy | None = None
        self.span = (0, 0)
        self.hs_bytes: torch.Tensor | None = None
        self.pinned = False

    def start(self, tensors: dict, spans: dict[str, tuple[int, int]] | None) -> Callable[[int, int], None] | None:
        n = self.n
        if set(tensors) != PL.tensor_names(n.dtype):
            raise InvalidSample(f"unexpected tensors {sorted(tensors)} for a {n.dtype} payload "
                                f"(expected {sorted(PL.tensor_names(n.dtype))})")  # fmt: skip
        hs, ids = tensors[P.HIDDEN_STATES_KEY], tensors[P.TOKEN_IDS_KEY]
        T = n.num_tokens
        if ids.dim() != 1 or ids.shape[0] != T:
            raise InvalidSample(f"token_ids shape {tuple(ids.shape)}, notice says {T} tokens")
        if tuple(hs.shape) != (T, len(n.layer_ids), n.hidden_size):
            raise InvalidSample(f"hidden_states shape {tuple(hs.shape)} != {(T, len(n.layer_ids), n.hidden_size)}")
        if str(hs.dtype).removeprefix("torch.") != n.dtype:
            raise InvalidSample(f"dtype {hs.dtype} != notice {n.dtype}")
        if self.dev is None or self.dev.type != "cuda":
            return None
        self.hs_bytes = hs.contiguous().view(-1).view(torch.uint8)
        nbytes = self.hs_bytes.numel()
        self.span = spans[P.HIDDEN_STATES_KEY] if spans is not None else (0, nbytes)
        self.pinned = hs.is_pinned()
        self.copy = DeviceCopy(hs.shape, hs.dtype, self.dev, self.tm, scales_like=tensors.get(PL.SCALES_KEY))
        return self._feed if spans is not None else (lambda a, b: self._feed(0, nbytes))

    def _feed(self, a: int, b: int) -> None:
        """Bytes [a, b) of the file are in: the hidden states' share of them goes to the device."""
        h0, h1 = self.span
        lo, hi = max(a, h0), min(b, h1)
        if lo < hi and self.copy is not None and self.hs_bytes is not None:
            self.copy.part(self.hs_bytes[lo - h0 : hi - h0], lo - h0, non_blocking=self.pinned)

    def host_checks(self, tensors: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The file is in: the checksum, the scales, finiteness on the host (without a device)
        and the scales' copy to the device; returns (hidden states, ids, scales), on the host."""
        hs, ids = tensors[P.HIDDEN_STATES_KEY], tensors[P.TOKEN_IDS_KEY]
        t0 = time.perf_counter()
        digest = P.checksum(*PL.checksum_buffers(tensors), algo=self.n.checksum_algo, threads=self.threads)
        self.tm["checksum_s"] = time.perf_counter() - t0
        if digest != self.n.checksum:
            raise InvalidSample("checksum mismatch")
        scales = tensors.get(PL.SCALES_KEY)
        if scales is not None:
            try:
                PL.check_scales(scales, self.n.num_tokens)
            except PL.PayloadError as e:
                raise InvalidSample(str(e)) from e
            if self.copy is not None:
                self.copy.scales(scales)
        if self.dev is None or self.dev.type == "cpu":
            t0 = time.perf_counter()
            if not all_finite(hs):
                raise InvalidSample("non-finite hidden states")
            self.tm["finite_s"] = time.perf_counter() - t0
        return hs, ids, scales


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)  # the reaper may have been first


_side = threading.local()  # one CUDA stream per check worker, so their copies overlap


class DeviceCopy:
    """Hidden states on their way to a CUDA ``device`` in parts (:meth:`part`: a non-blocking
    copy from pinned memory on this thread's own side stream), with their finiteness checked
    there once the last part is queued (a fraction of a millisecond on the GPU; the host's
    exponent-bit scan is several ms per 33.5 MB), so the host goes on (reading, hashing)
    meanwhile; :meth:`finish` waits and returns the tensors, complete, or raises
    :class:`InvalidSample`. They are allocated on the device's current stream and marked used by
    the side stream, so the caching allocator never hands them out early (torch's pinned cache
    likewise keeps a source buffer until the copies reading it are done). The FP8 scales' buffer
    (``scales_like``: their shape and dtype, known from the header) is allocated with them,
    before the side stream's one wait: allocated later, it could be a block the trainer's step
    just freed on the current stream, still in use by kernels the side stream never waited for."""

    def __init__(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 timings: dict[str, float] | None = None, scales_like: torch.Tensor | None = None) -> None:  # fmt: skip
        self.t0 = time.perf_counter()
        self.timings = timings
        s = getattr(_side, "stream", None)
        if s is None or s.device != device:
            s = _side.stream = torch.cuda.Stream(device)
        self.stream = s
        self.device = device
        self.out = torch.empty(shape, dtype=dtype, device=device)
        self.bytes = self.out.view(-1).view(torch.uint8)
        self.sc = None if scales_like is None else torch.empty(scales_like.shape, dtype=scales_like.dtype,
                                                               device=device)  # fmt: skip
        self.ok: torch.Tensor | None = None
        s.wait_stream(torch.cuda.current_stream(device))  # the allocations are ordered before the copies
        for t in (self.out, self.sc):
            if t is not None:
                t.record_stream(s)

    def part(self, src: torch.Tensor, offset: int, *, non_blocking: bool = True) -> None:
        """Bytes ``src`` (uint8, on the host) of the hidden states, at byte ``offset``."""
        with torch.cuda.stream(self.stream):
            self.bytes[offset : offset + src.numel()].copy_(src, non_blocking=non_blocking)
            if offset + src.numel() == self.bytes.numel():
                self.ok = torch.isfinite(self.out).all()

    def scales(self, scales: torch.Tensor) -> None:
        """The FP8 scales, into the buffer ``scales_like`` announced (allocated before the wait)."""
        if self.sc is None or self.sc.shape != scales.shape or self.sc.dtype != scales.dtype:
            raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype} were not announced (scales_like)")
        with torch.cuda.stream(self.stream):
            self.sc.copy_(scales, non_blocking=scales.is_pinned())

    def finish(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.cuda.stream(self.stream):
            if self.ok is None:  # no bytes (0 tokens)
                self.ok = torch.isfinite(self.out).all()
            ok = bool(self.ok)  # waits for the copies and the check on the side stream
        if self.timings is not None:
            self.timings["to_device_s"] = time.perf_counter() - self.t0
        if not ok:
            raise InvalidSample("non-finite hidden states (checked on the device)")
        return self.out, self.sc


def to_device_checked(hs: torch.Tensor, scales: torch.Tensor | None, device: torch.device,
                      timings: dict[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``hs`` (and ``scales``) copied to ``device``, raising :class:`InvalidSample` unless every
    value is finite, checked there (:class:`DeviceCopy` on CUDA)."""
    if device.type == "cuda":
        copy = DeviceCopy(hs.shape, hs.dtype, device, timings, scales_like=scales)
        copy.part(hs.contiguous().view(-1).view(torch.uint8), 0, non_blocking=hs.is_pinned())
        if scales is not None:
            copy.scales(scales)
        return copy.finish()
    t0 = time.perf_counter()
    out = hs.to(device)
    sc = scales.to(device) if scales is not None else None
    ok = all_finite(out)
    if timings is not None:
        timings["to_device_s"] = time.perf_counter() - t0
    if not ok:
        raise InvalidSample("non-finite hidden states (checked on the device)")
    return out, sc


def read_hidden_states(path: str | os.PathLike[str], expected_token_ids: list[int] | None = None, *,
                       dequantize: torch.dtype | None = torch.bfloat16) -> Sample:  # fmt: skip
    """Read and validate one file our connector wrote, without a sidecar: shapes, dtype,
    checksum, finite values and token ids against the notice in its header (and against
    ``expected_token_ids`` if given). Works for plain vLLM requests (no sample key; ``key`` is
    None). Wait for the file first as for vLLM's Example connector (``<path>.lock``).
    ``dequantize``: the dtype an FP8 payload is turned into (None: keep FP8 + ``scales``)."""
    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure is an invalid file
        raise InvalidSample(f"{p}: not a readable safetensors file: {e}") from e
    if P.HEADER_NOTICE_KEY not in meta:
        raise InvalidSample(f"{p}: no {P.HEADER_NOTICE_KEY} in its header (not written by this connector)")
    try:
        n = P.Notice.decode(meta[P.HEADER_NOTICE_KEY])
    except P.ProtocolError as e:
        raise InvalidSample(f"{p}: bad header notice: {e}") from e
    if n.status != P.NoticeStatus.ok:
        raise InvalidSample(f"{p}: header notice has status {n.status.value}")
    d = P.Deliver(notice=n.model_copy(update={"file": p.name}), expected_token_ids=expected_token_ids)
    return load_and_check(p.parent, d, require_key=False).dequantized(dequantize)


#: Most keys in one ACK message (the deferred acks of a checkpoint can be many thousands): about
#: 100 bytes each, far below the sidecar's HSSTREAM_MAX_PEER_MESSAGE_BYTES.
ACK_KEYS = 1024


class HiddenStateStream:
    """Iterate samples from a sidecar. Use as a context manager so leases are returned.

    ``ack="use"`` acknowledges a sample when the next one is requested (the loop is done
    with it); ``ack="manual"`` waits for :meth:`ack_through` / :meth:`ack_all_used`.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        jobs: list[str] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        credit: int = 8,
        ack: str = "use",
        follow: bool = False,
        timeout_s: float = 600.0,
        heartbeat_s: float = 2.0,
        sidecar_silence_s: float = 10.0,
        curve_server_key: str | bytes | None = None,
        curve_client_cert: str | os.PathLike[str] | None = None,
        acked_memory: int = 65536,
        pin_memory: bool = False,
        idle_s: float | None = None,
        transport: str | None = None,
        dequantize: torch.dtype | None = torch.bfloat16,
        workers: int | None = None,
        device: torch.device | str | None = None,
        host_buffers: HostBuffers | None = None,
        ordered: bool | None = None,
    ) -> None:
        """``endpoint`` ``ipc://…`` reads the spool on this host; ``tcp://…`` is a remote
        sidecar, authenticated with CURVE: ``curve_server_key`` is the sidecar's public key (or
        its ``.key`` file), ``curve_client_cert`` this trainer's ``.key_secret`` file, whose
        public half must be in the sidecar's clients directory. Without them a ``tcp://``
        endpoint is refused (``InsecureEndpoint``) unless ``HSSTREAM_ALLOW_INSECURE_TCP=1``.

        ``transport`` (default ``HSSTREAM_TRANSPORT``, else ``spool`` for ``ipc://`` and ``zmq``
        for ``tcp://``): how the bytes come (``connector/transport/``). ``spool`` reads the
        file on this host; ``zmq`` gets them in the sidecar's message; ``mooncake`` reads them
        from the sidecar's host with the Mooncake Transfer Engine (the sidecar needs
        ``HSSTREAM_MOONCAKE_HOSTNAME``; this host's address is ``HSSTREAM_MOONCAKE_HOSTNAME``
        here, else the one on the route to the sidecar).

        ``acked_memory``: how many of the latest acked keys the stream remembers, so that a
        sample redelivered before the sidecar saw our ack (ack still queued, lease lapsed, sidecar
        restarted) is dropped, never yielded twice. Older keys are the ledger's to remember: once
        the sidecar has the ack the sample is CONSUMED and never delivered again.


        ``pin_memory``: samples are read into page-locked memory (for ``non_blocking`` copies
        to a GPU). ``idle_s``: the iterator yields ``None`` after that long without a sample,
        so a loop on the socket's thread can do other work (a collective with other ranks, a
        checkpoint and its acks) instead of blocking while it holds unacknowledged samples.

        ``dequantize``: the dtype FP8 payloads (``HSSTREAM_PAYLOAD_DTYPE=fp8_e4m3``) are turned
        into before they are yielded, after validation; None yields them as stored (FP8
        ``hidden_states`` + ``sample.scales``) for a trainer that dequantises on its GPU.
        Unquantised payloads are yielded as they are either way.

        ``workers`` (default ``HSSTREAM_STREAM_WORKERS``): threads that read and check delivered
        samples (``check_pool.py``), so a burst of deliveries is checked in parallel instead of
        queueing behind one thread; 0 checks each on the iterating thread. Only the iterating
        thread touches the socket. At most ``credit`` samples are held in the pool (its memory
        bound). ``ordered`` (default ``HSSTREAM_STREAM_ORDERED``, off): samples are yielded in
        delivery order; off, each as soon as it is checked (the sidecar's delivery order is
        vLLM's completion order anyway, so nothing a trainer relies on is lost, and a sample
        checked first is not held behind an older one).

        ``device`` (the trainer's, e.g. ``"cuda:0"``): each sample's hidden states are copied
        there by the worker that checked it, and their finiteness is checked there instead of on
        the host; the yielded ``hidden_states`` live on that device. Implies ``pin_memory``.
        None or CPU: checked on the host as always. ``host_buffers``: where pinned samples are
        read into (``host_buffers.py``; by default torch's pinned cache, warmed at the first
        delivery).
        """
        s = Settings()
        self.endpoint = endpoint or s.delivery_ep()
        self.spool = Path(spool_dir or s.spool_dir)
        self.jobs = jobs
        self.credit = max(1, credit)
        if ack not in ("use", "manual"):
            raise ValueError("ack must be 'use' or 'manual'")
        self.ack_mode = ack
        self.follow = follow
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.sidecar_silence_s = sidecar_silence_s  # the sidecar heartbeats every second
        self._last_recv = time.monotonic()
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._acked: OrderedDict[P.SampleKey, None] = OrderedDict()  # newest last, at most acked_memory
        self.acked_memory = max(1, acked_memory)
        self._used: list[P.SampleKey] = []  # yielded, not yet acked, in order
        self._used_set: set[P.SampleKey] = set()
        # The lease token of each admitted, not yet acked key's latest DELIVER: the sidecar
        # counts an ACK only with it, and a redelivery (a lapsed lease, a sidecar restart) replaces it.
        self._tokens: dict[P.SampleKey, str] = {}
        self._last_send = 0.0
        self._last_beat = 0.0
        self._started: float | None = None  # first __iter__
        self._waited = 0.0  # seconds the loop spent in the stream waiting for a sample
        self._waiting_since: float | None = None  # inside __iter__, not yet yielded
        self._outbox: deque[list[bytes]] = deque()
        self.remote = E.is_network(self.endpoint)
        if bool(curve_server_key) != bool(curve_client_cert):
            raise ValueError("CURVE needs both curve_server_key and curve_client_cert")
        self._curve = (curve_server_key, curve_client_cert) if curve_server_key else None
        if self.remote and self._curve is None:  # refused unless HSSTREAM_ALLOW_INSECURE_TCP=1 (then a WARNING)
            E.check_plain("HiddenStateStream endpoint", self.endpoint, allow=s.allow_insecure_tcp,
                          exposes=E.DELIVERY_EXPOSES, fix=E.STREAM_FIX)  # fmt: skip
        self.transport = transport or s.transport or ("zmq" if self.remote else "spool")
        if self.transport not in P.TRANSPORTS:
            raise ValueError(f"transport {self.transport!r}: one of {', '.join(P.TRANSPORTS)}")
        if self.remote and self.transport == "spool":
            raise ValueError(f"{self.endpoint} is remote: its spool is on another host (transport zmq or mooncake)")
        self._settings = s
        self._receiver: Receiver | None = None  # built at the first connection (Mooncake starts an engine)
        self._hello = P.Hello(jobs=jobs, follow=follow, same_host=not self.remote, transport=self.transport)
        self.device = torch.device(device) if device is not None else None
        on_gpu = self.device is not None and self.device.type != "cpu"
        self.pin_memory = pin_memory or on_gpu
        self.host_buffers = host_buffers or HostBuffers(pinned=self.pin_memory)
        self.workers = s.stream_workers if workers is None else workers
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (got {self.workers})")
        self.ordered = s.stream_ordered if ordered is None else ordered
        self._pool = CheckPool(self.workers, limit=self.credit, ordered=self.ordered)
        if self.workers:
            lower_switch_interval(s.switch_interval_ms)  # the socket's thread vs the workers' Python
        # Spool files of checked samples are renamed out of the spool on the socket's thread and
        # deleted here: freeing a 33.5 MB tmpfs file takes ~4 ms, which sat between a sample's
        # check and its yield. Bounded (finished deletes are collected every loop); past the
        # bound a file is deleted inline. Such a sample's RECEIVED (the sidecar frees its spool
        # budget on it) waits for its delete: sent at once, the spool held the renamed bytes on
        # top of the budget until the deleter got to them (test_reliability saw 294 kB of 200).
        self._deletes = CheckPool(1 if self.workers else 0, limit=4 * self.credit + 16, ordered=False)
        self._held: dict[P.SampleKey, str | None] = {}  # keys in the pool -> their files
        self._view_job: Future | None = None  # the job reading the transport's reused buffer
        self.idle_s = idle_s
        self.dequantize = dequantize
        # wait_s: time the iterator spent with nothing from the sidecar (waiting for data);
        # load_s: reading and validating samples (summed over the workers); check_wait_s: time
        # the iterator waited for a worker with nothing else to do.
        self.stats = {"delivered": 0, "yielded": 0, "invalid": 0, "not_received": 0, "duplicates": 0, "bytes": 0,
                      "reconnects": 0, "wait_s": 0.0, "load_s": 0.0, "check_wait_s": 0.0}  # fmt: skip
        self._unread_run = 0  # deliveries in a row whose file could not be read (_not_received)

    @property
    def waited_s(self) -> float:
        """Seconds the loop has spent in the stream waiting for samples (the wait under way too)."""
        now = time.monotonic()
        return self._waited + (now - self._waiting_since if self._waiting_since is not None else 0.0)

    def _heartbeat(self) -> P.Heartbeat:
        alive = time.monotonic() - self._started if self._started is not None else 0.0
        return P.Heartbeat(hello=self._hello, window=self.credit, alive_s=round(alive, 3),
                           waited_s=round(min(self.waited_s, alive), 3))  # fmt: skip

    # -- socket -------------------------------------------------------------------------------
    def _connect(self) -> zmq.Socket:
        if self._receiver is None:
            kw: dict = {}
            if self.transport == "mooncake":
                from connector.transport.mooncake import local_address_towards

                s = self._settings
                kw = {"hostname": s.mooncake_hostname or local_address_towards(self.endpoint),
                      "protocol": s.mooncake_protocol, "device": s.mooncake_device}  # fmt: skip
            try:
                self._receiver = make_receiver(self.transport, **kw)
            except TransportError as e:
                raise StreamError(str(e)) from e
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)
            if self.remote and self._curve is not None:
                server_key, cert = self._curve
                if isinstance(server_key, str) and os.path.exists(server_key):
                    server_key = zmq.auth.load_certificate(server_key)[0]
                pub, sec = load_secret(cert)  # refuses a secret others can read
                if sec is None:
                    raise ValueError(f"{cert} holds no secret key (pass the .key_secret file)")
                sock.curve_serverkey = server_key.encode() if isinstance(server_key, str) else server_key
                sock.curve_publickey, sock.curve_secretkey = pub, sec
            sock.connect(self.endpoint)
            self._sock = sock
            self._last_recv = time.monotonic()
            self._outbox.appendleft(P.encode_msg(P.Credit(n=self.credit)))
            self._outbox.appendleft(P.encode_msg(self._hello))
            self._flush()
        return self._sock

    def _reconnect(self) -> zmq.Socket:
        """The sidecar has been silent (it heartbeats every second): drop the connection and
        start a fresh one (the ZeroMQ Guide's Paranoid Pirate). Acks still queued are kept;
        the old credit is replaced by a new HELLO and full window. Samples the old connection
        held come back to us or another trainer when their leases lapse; one we still hold
        unacked is dropped on redelivery, one we acked is acked again."""
        log.warning("sidecar at %s silent for %.0f s: reconnecting", self.endpoint, time.monotonic() - self._last_recv)
        self.stats["reconnects"] += 1
        credit = P.MsgType.credit.value.encode()
        kept = [m for m in self._outbox if m[0] != credit]
        self._outbox.clear()
        self._outbox.extend(kept)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        return self._connect()

    def _send(self, body) -> None:  # noqa: ANN001
        """Queue a message and send what can go now. Never blocks: with no sidecar connected
        (not up yet, restarting, or refusing our CURVE key) ZeroMQ would block the training
        loop; instead acks and credit wait in order in the outbox until a peer is there."""
        self._outbox.append(P.encode_msg(body))
        self._flush()

    def _flush(self) -> None:
        assert self._sock is not None
        while self._outbox:
            try:
                self._sock.send_multipart(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()
            self._last_send = time.monotonic()

    # -- acknowledgement ------------------------------------------------------------------------
    def ack_through(self, key: P.SampleKey) -> None:
        """Acknowledge every yielded sample up to and including ``key`` (e.g. at a checkpoint)."""
        if key not in self._used:
            return
        i = self._used.index(key)
        self._ack(self._used[: i + 1])
        self._used_set.difference_update(self._used[: i + 1])
        del self._used[: i + 1]

    def ack_all_used(self) -> None:
        self._ack(self._used)
        self._used = []
        self._used_set.clear()

    def _ack(self, keys: list[P.SampleKey]) -> None:
        keys = [k for k in keys if k not in self._acked]
        if keys and self._sock is not None:
            self._collect_deletes(wait_for=set(keys))  # a sample's RECEIVED before its ACK
            for lo in range(0, len(keys), ACK_KEYS):  # each message well within the sidecar's size limit
                part = keys[lo : lo + ACK_KEYS]
                self._send(P.Ack(keys=part, tokens=[self._tokens.pop(k, "") for k in part]))
            for k in keys:
                self._acked[k] = None
            while len(self._acked) > self.acked_memory:
                self._acked.popitem(last=False)

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Sample]:
        """Samples as they are checked (``ordered``: in delivery order). Each delivery is
        admitted here (duplicates dropped), read and checked by a worker, and settled here when
        the pool hands it back (``ordered``: when it is the oldest held): FAIL for an invalid
        one, else its file removed (renamed away, freed by the deleter, RECEIVED once it has)
        and the sample yielded. One CREDIT goes back per delivery when it leaves the pool
        (settled) or is dropped, so at most ``credit`` samples are ever held, whatever the
        pool's speed."""
        sock = self._connect()
        deadline = time.monotonic() + self.timeout_s
        if self._started is None:
            self._started = time.monotonic()
        self._waiting_since = time.monotonic()  # from here to the yield, the loop waits on us
        idle_since = time.monotonic()
        end: P.End | None = None
        while True:
            if self.ack_mode == "use" and self._used:
                self.ack_all_used()
            self._flush()
            self._collect_deletes()
            # Every heartbeat_s, busy or not: it carries the wait share, not only liveness.
            if time.monotonic() - self._last_beat > self.heartbeat_s and not self._outbox:
                self._last_beat = time.monotonic()
                self._send(self._heartbeat())
            if self._pool.has_result():
                sample = self._settle(*self._pool.pop())
                self._send(P.Credit(n=1))
                if sample is None:
                    continue
                self._used.append(sample.key)
                self._used_set.add(sample.key)
                self.stats["yielded"] += 1
                self._waited += time.monotonic() - self._waiting_since
                self._waiting_since = None
                sample.timings["handed"] = time.time()
                yield sample
                self._waiting_since = time.monotonic()
                idle_since = time.monotonic()
                continue
            if end is not None and not len(self._pool):  # what came before the END is yielded first
                self._waited, self._waiting_since = self.waited_s, None
                if end.reason != "complete":
                    raise StreamError(f"the sidecar at {self.endpoint} refused this stream: {end.reason}")
                return
            busy = len(self._pool) > 0
            take = end is None and not self._pool.full  # else only a worker's result can come
            poller = zmq.Poller()
            if take:
                poller.register(sock, zmq.POLLIN)
            if self._pool.fileno() >= 0:
                poller.register(self._pool.fileno(), zmq.POLLIN)
            if len(self._deletes) and self._deletes.fileno() >= 0:  # a RECEIVED to send once done
                poller.register(self._deletes.fileno(), zmq.POLLIN)
            t0 = time.perf_counter()
            events = dict(poller.poll(int(min(self.heartbeat_s, 0.5, self.idle_s or 0.5) * 1000)))
            self.stats["check_wait_s" if busy else "wait_s"] += time.perf_counter() - t0
            self._pool.clear_wakeups()
            self._deletes.clear_wakeups()  # its finished deletes are collected at the loop's top
            if sock not in events:
                if busy:
                    continue  # a worker is on it: the sidecar's silence and our deadline wait
                if time.monotonic() - self._last_recv > self.sidecar_silence_s:
                    sock = self._reconnect()
                if time.monotonic() > deadline:
                    why = (" (nothing could be sent: no connection; for tcp:// check the CURVE keys)"
                           if self._outbox else " (is it running, and is the job producing?)")  # fmt: skip
                    raise StreamError(f"no sample from the sidecar at {self.endpoint} for {self.timeout_s:.0f} s{why}")
                if self.idle_s is not None and time.monotonic() - idle_since >= self.idle_s:
                    self._waited, self._waiting_since = self.waited_s, None  # the loop's own time
                    yield None  # type: ignore[misc]
                    self._waiting_since = idle_since = time.monotonic()
                continue
            # A burst: take what has arrived (up to the pool's bound) so the workers start at once.
            while end is None and not self._pool.full:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._last_recv = time.monotonic()
                msg = P.decode_msg(frames)
                if isinstance(msg, P.End):
                    end = msg
                elif isinstance(msg, P.Deliver):
                    deadline = time.monotonic() + self.timeout_s
                    self.stats["delivered"] += 1
                    self._submit(msg, P.payload_of(frames))
                    if self.workers == 0:
                        break  # checked inline already: hand it over before reading the next
                # else a heartbeat: the sidecar is alive, but it is no sample (timeout_s runs on)

    def _admit(self, d: P.Deliver) -> bool:
        """Whether a delivery is to be read; a duplicate is dropped here, on the socket's thread."""
        key = d.notice.key
        if key is None:
            return False
        if key in self._acked:  # redelivered after we acked: never yield twice
            self._acked.move_to_end(key)  # the sidecar has not seen our ack yet: keep it fresh
            self.stats["duplicates"] += 1
            self._drop_copy(d)
            self._send(P.Ack(keys=[key], tokens=[d.token]))
            return False
        self._tokens[key] = d.token  # the latest lease: the one our ack must name
        if key in self._used_set:
            # Redelivered while we hold it unacked (our lease lapsed, e.g. a long checkpoint):
            # the loop already has this sample; its later ack settles this copy too.
            self.stats["duplicates"] += 1
            self._drop_copy(d)
            return False
        if key in self._held:
            # Redelivered while a worker still has it: that copy is yielded; this one's file is
            # freed unless it is the very file the worker reads (then that worker's settling does).
            self.stats["duplicates"] += 1
            if d.notice.file != self._held[key]:
                self._drop_copy(d)
            return False
        return True

    def _fetch(self, d: P.Deliver, payload: bytes | memoryview | None) -> bytes | memoryview | None:
        assert self._receiver is not None
        if self._view_job is not None:  # the transport reuses one buffer: its reader must be done
            self._pool.wait_for(self._view_job)
            self._view_job = None
        try:
            return self._receiver.fetch(d, payload)
        except TransportError as e:
            # Not the sample's fault: stop with the reason; nothing is reported failed and the
            # lease goes back to the sidecar.
            raise StreamError(f"sample {d.notice.key}: {e} (no sample was reported failed)") from e

    def _submit(self, d: P.Deliver, payload: bytes | memoryview | None) -> None:
        if not self._admit(d):
            self._send(P.Credit(n=1))
            return
        received = time.time()
        data = self._fetch(d, payload)
        if self.pin_memory and not self.host_buffers.stats["warmed"]:
            # Before the first burst: one cached pinned block per sample the pool may hold.
            n = d.notice
            self.host_buffers.warm(n.nbytes + 8 * n.num_tokens + P.HEADER_ALLOWANCE, self.credit + 1)
        job = self._pool.submit(d, self._load, d, data, received)
        self._held[d.notice.key] = d.notice.file  # type: ignore[index]
        if isinstance(data, memoryview):
            self._view_job = job

    def _load(self, d: P.Deliver, data: bytes | memoryview | None, received: float) -> Sample:
        """Read and check one delivery (on a worker: touches no socket and no stream state)."""
        tm: dict[str, float] = {"received": received, "started": time.time()}
        spool = self.spool if self._receiver is not None and self._receiver.reads_spool else None
        sample = load_and_check(spool, d, data, pin_memory=self.pin_memory, device=self.device,
                                alloc=self.host_buffers.alloc, timings=tm)  # fmt: skip
        sample = sample.dequantized(self.dequantize)
        tm["checked"] = time.time()
        sample.timings = tm
        return sample

    def _settle(self, d: P.Deliver, job: Future) -> Sample | None:
        """A finished job, on the socket's thread: the sample, or None after reporting it failed."""
        key = d.notice.key
        self._held.pop(key, None)  # type: ignore[arg-type]
        try:
            sample = job.result()
        except OSError as e:
            if not self._reads_a_marked_spool():
                # A wrong spool_dir: reporting the sample failed, or not received, would churn
                # every sample of the job. Stop at once; nothing is reported, and the lease goes
                # back to the sidecar.
                raise StreamError(
                    f"cannot read delivered file {d.notice.file!r} in spool_dir {self.spool}: {e.strerror or e}, "
                    f"and it is not a spool (no {P.SPOOL_MARKER} marker). Is spool_dir the sidecar's "
                    "HSSTREAM_SPOOL_DIR on this host? (no sample was reported failed)"
                ) from e
            self._not_received(d, e)
            return None
        except (InvalidSample, P.ProtocolError, ValueError) as e:
            self._unread_run = 0
            self.stats["invalid"] += 1
            log.warning("sample %s rejected: %s", key, e)
            self._tokens.pop(key, None)  # type: ignore[arg-type]
            self._send(P.Fail(key=key, reason=str(e)[:500], token=d.token))  # type: ignore[arg-type]
            return None
        self._unread_run = 0
        tm = sample.timings
        if "started" in tm and "checked" in tm:
            self.stats["load_s"] += tm["checked"] - tm["started"]
        # The tensors are in memory (read or copied out of the file): the file can go now.
        self.stats["bytes"] += d.notice.nbytes
        self._drop_copy(d, aside=True)
        return sample

    def _reads_a_marked_spool(self) -> bool:
        """Whether this stream reads a spool, and ``spool_dir`` is one (a directory with the
        sidecar's marker): then a file missing from it is a race, not a misconfiguration."""
        if self._receiver is None or not self._receiver.reads_spool:
            return False
        try:
            return P.is_marked_spool(self.spool)
        except OSError:  # e.g. another user's 0700 spool
            return False

    def _not_received(self, d: P.Deliver, e: OSError) -> None:
        """A delivered file is gone or unreadable in our spool (deleted by hand or by a clean-up,
        or a transient read error): the sample is fine, we just never had it. FAIL with
        ``not_received`` has the sidecar produce it again without spending an attempt. A long
        run of them means this spool is not the sidecar's (another stack's marked spool): every
        sample would go round forever, so the stream stops instead."""
        key = d.notice.key
        self.stats["not_received"] += 1
        self._unread_run += 1
        why = e.strerror or str(e)
        log.warning("sample %s not received: cannot read %s in %s (%s); the sidecar produces it again",
                    key, d.notice.file, self.spool, why)  # fmt: skip
        self._tokens.pop(key, None)  # type: ignore[arg-type]
        self._send(P.Fail(key=key, reason=f"not received: {why}"[:500], not_received=True,  # type: ignore[arg-type]
                          token=d.token))
        if self._unread_run >= max(16, 2 * self.credit):
            raise StreamError(
                f"{self._unread_run} delivered files in a row could not be read in spool_dir {self.spool} "
                f"(last: {d.notice.file!r}: {why}). Is spool_dir the spool of the sidecar at {self.endpoint}?"
            ) from e

    def _collect_deletes(self, wait_for: Iterable[P.SampleKey] = (), *, every: bool = False) -> None:
        """Take back the deleter's finished jobs and send their RECEIVEDs (what failed is the
        reaper's: the file has a temporary name of ours). ``wait_for``: keys whose deletes are
        waited for first (their RECEIVED must precede their ACK); ``every``: all deletes."""
        if wait_for or every:
            futures.wait([f for d, f in self._deletes.held() if every or d.notice.key in wait_for])
        while self._deletes.has_result():
            d, job = self._deletes.pop()
            try:
                job.result()
            except OSError as e:
                log.warning("could not delete %s's retired copy from the spool: %s", d.notice.file, e)
            if d.notice.key is not None and self._sock is not None:
                self._send(P.Received(keys=[d.notice.key], tokens=[d.token]))

    def _take(self, d: P.Deliver, payload: bytes | None = None) -> Sample | None:
        """One delivery admitted, read, checked and settled on this thread (no pool)."""
        if not self._admit(d):
            return None
        data = self._fetch(d, payload)
        job: Future = Future()
        try:
            job.set_result(self._load(d, data, time.time()))
        except Exception as e:  # noqa: BLE001 - settled below exactly as a worker's result
            job.set_exception(e)
        return self._settle(d, job)

    def _drop_copy(self, d: P.Deliver, *, aside: bool = False) -> None:
        """Free the delivered file (ours to delete when we read the spool; else the sidecar
        deletes its own on RECEIVED) and tell the sidecar its spool bytes are free. ``aside``:
        renamed out of the spool now (for the sidecar, as if deleted), its bytes freed by the
        deleter thread, unless that has no thread or is full."""
        if self._receiver is not None and self._receiver.reads_spool:
            if aside and self._deletes.workers and not self._deletes.full:
                if (retired := P.retire_from_spool(self.spool, d.notice.file)) is not None:
                    self._deletes.submit(d, _unlink, retired)
                    return  # its RECEIVED goes once the bytes are freed (_collect_deletes)
            else:
                P.remove_from_spool(self.spool, d.notice.file)
        if d.notice.key is not None:
            self._send(P.Received(keys=[d.notice.key], tokens=[d.token]))

    def keepalive(self) -> None:
        """Tell the sidecar we are alive during long pauses between samples (a checkpoint, an
        evaluation); call it from the thread that iterates. Leases lapse after the sidecar's
        HSSTREAM_TRAINER_TIMEOUT_S of silence and the samples are produced again."""
        if self._sock is not None:
            self._flush()
            self._last_beat = time.monotonic()
            self._send(self._heartbeat())

    def close(self, *, failed: bool = False) -> None:
        """Return leases and send pending acks. With ``ack="use"`` the sample yielded last is
        not acked: the loop never asked past it (it broke out, or stopped on an error:
        ``failed``), so it may not have been used, and it comes back; a sample trained twice
        is harmless, one acked unused is lost.

        Samples the pool still holds (delivered, not yet yielded) are finished first and settled
        as usual — an invalid one reported failed, a read one's file removed and RECEIVED sent —
        but not yielded or acked, so the sidecar produces them again; then the workers stop."""
        unread: list[str] = []
        for d, job in self._pool.close():
            self._held.pop(d.notice.key, None)  # type: ignore[arg-type]
            if self._sock is None:
                continue
            try:
                self._settle(d, job)
            except StreamError as e:  # the error the loop saw (or will not see now): the lease goes back
                unread.append(str(e))
        if unread:
            log.warning("closing: %d delivered sample(s) not read, their leases go back: %s", len(unread), unread[0])
        self._view_job = None
        if self._sock is not None:
            self._collect_deletes(every=True)  # every RECEIVED before the acks
            if self.ack_mode == "use":
                if self._used:
                    self._used_set.discard(self._used.pop())
                self.ack_all_used()
            t0 = time.monotonic()  # give queued acks a moment to go; unacked samples come back anyway
            while self._outbox and time.monotonic() - t0 < 2.0:
                self._flush()
                time.sleep(0.01)
            self._sock.close(linger=0 if self._outbox else 2000)
            self._sock = None
        self._deletes.close()  # the retired copies' deletes finish first
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def __enter__(self) -> HiddenStateStream:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)
