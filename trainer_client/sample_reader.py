"""Reading a sample file into memory: mapped by safetensors, or read into one (pinned) buffer
in parts on a few threads, its header parsed first by the contract's one parser
(``connector/contract/sample_file.py``) so that checks and a GPU copy can start before the data
is all in (``on_header``). Nothing here checks a sample against its notice: that is
``sample_checks.py``, which hands this module its callback.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

from connector.contract import payload as PL
from connector.contract import sample_file as SF
from connector.contract.sample_file import MAX_HEADER_BYTES, InvalidSample

__all__ = ["HEAD_BYTES", "MAX_HEADER_BYTES", "READ_PART", "READ_THREADS", "InvalidSample", "OnHeader",
           "read_into_buffer", "read_parallel", "read_sample_file", "shared_pool"]


def read_sample_file(path: Path | None = None, payload: bytes | memoryview | None = None, *,
                     pin_memory: bool = False, alloc: Callable[[int], torch.Tensor] | None = None,
                     timings: dict[str, float] | None = None, on_header: OnHeader | None = None) -> dict:  # fmt: skip
    """A sample file's tensors (from the spool, or the bytes a remote sidecar sent).

    Unpinned, safetensors maps the file: no copy at all, the checks read the pages in place.
    Pinned (the trainer copies to a GPU): the file goes straight into one page-locked buffer
    with one read — safetensors has no way to read into a caller's buffer, and pinning its
    tensors afterwards would copy the whole sample once more; torch's pinned allocator hands
    the same buffers back sample after sample, so they are not faulted in again each time
    (fresh memory's page faults cost more than the read).
    ``alloc``: where the pinned buffer comes from (``host_buffers.HostBuffers.alloc``).
    ``on_header``: see :func:`read_into_buffer` (unpinned, it sees the whole file at once).
    """
    if not pin_memory:
        if isinstance(payload, memoryview):  # a transport's reused buffer: copy out once, views of it
            return read_into_buffer(None, payload, lambda n: torch.empty(n, dtype=torch.uint8), timings, on_header)
        try:
            if payload is not None:
                SF.header_length(bytes(payload[:8]), len(payload))  # its limit is ours
                out = safetensors_load(payload)
            else:
                with open(path, "rb") as f:  # type: ignore[arg-type]
                    SF.header_length(f.read(8), os.fstat(f.fileno()).st_size)
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
#: the whole: blake3 fed in parts runs on one core, one call on the whole uses all of them.)
OnHeader = Callable[[dict, "dict[str, tuple[int, int]] | None"], "Callable[[int, int], None] | None"]

#: A file is read in parts of this many bytes, on up to READ_THREADS threads at once
#: (``HSSTREAM_READ_THREADS``), taken in file order: one thread does not read tmpfs as fast as
#: a GPU takes samples, and the kernel's copy scales with threads (docs/benchmarks.md). Parts
#: smaller than a thread's share let the first ones be copied to the GPU while the rest are read.
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


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's pool ``hsstream-<name>`` (the file readers, the finiteness scan)."""
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

    pool = shared_pool("read", 2 * READ_THREADS)
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
            hlen = SF.header_length(view[:8].tobytes(), size)
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


def _tensors_in(buf: torch.Tensor, view: np.ndarray, size: int) -> tuple[dict, dict[str, tuple[int, int]]]:
    """The tensors the header at the start of ``buf`` describes (views of it) and their byte
    spans, by the contract's parser (every malformed header an :class:`InvalidSample`)."""
    hlen = SF.header_length(view[:8].tobytes(), size)
    spans, _ = SF.parse_header(view[: 8 + hlen].tobytes(), size, PL.safetensors_itemsizes())
    out = {name: buf[sp.start : sp.end].view(PL.safetensors_torch_dtype(sp.dtype)).view(sp.shape)
           for name, sp in spans.items()}  # fmt: skip
    return out, {name: (sp.start, sp.end) for name, sp in spans.items()}
