"""Reading a sample file into memory: mapped by safetensors, or read into one (pinned) buffer
in parts on a few threads, its header parsed first by the contract's one parser
(``connector/contract/sample_file.py``) so that checks and a GPU copy can start before the data
is all in (``on_header``). Nothing here checks a sample against its notice: that is
``sample_checks.py``, which hands this module its callback.

A sample of the arena layout (``connector/contract/arena.py``) is not read at all: its slot is
parsed in place (:func:`read_slot`) and its tensors are views of the arena, mapped once per
stream, copy-on-write (:class:`ArenaMaps`): an in-place op on them never reaches the shared slot.
The slot is held (a read lock on its bytes, ``arena.SlotReads``) from before its header is read
while any view of it is alive, so the sidecar cannot give it to another sample meanwhile, even
across its own restart; the caller learns when no view is left (``on_release``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

from connector.contract import arena as A
from connector.contract import payload as PL
from connector.contract import sample_file as SF
from connector.contract.sample_file import MAX_HEADER_BYTES, InvalidSample

log = logging.getLogger("hsstream.trainer")

__all__ = ["HEAD_BYTES", "MAX_HEADER_BYTES", "READ_PART", "READ_THREADS", "ArenaMaps", "InvalidSample", "OnHeader",
           "SlotNotReadable", "read_into_buffer", "read_parallel", "read_sample_file", "read_slot", "shared_pool",
           "slot_is_copied"]


class SlotNotReadable(Exception):
    """A delivered slot this trainer cannot reach: no arena in its spool, another arena than the
    slot's (the sidecar made a new one), a slot past its end. Not the sample's fault: the stream
    reports it FAIL ``not_received`` (produced again, no attempt spent)."""


class ArenaMaps:
    """One stream's mapping of its spool's arena, copy-on-write (``Arena.open(private=True)``):
    opened at the first slot, and again when a slot names another arena (a new one replaced it);
    thread-safe (the check workers share it). A mapping replaced while views of it live stays
    mapped, its slots held, until the last view goes.

    Never page-locked for CUDA (``cudaHostRegister``): pinning a private mapping writable breaks
    its copy-on-write (every page becomes this process's own copy, and the slots written later
    would not be seen), so a slot bound for a CUDA device is copied out into a pinned buffer first
    (:func:`slot_is_copied`)."""

    def __init__(self, spool: str | os.PathLike[str], *, prefault: bool = True) -> None:
        """``prefault``: map the slots past each one read ahead of their turn, in the background
        (:meth:`~connector.contract.arena.Arena.prefault_ahead`); off only for
        ``bench/arena/arena_pages.py``'s control arm."""
        self.spool = spool
        self.prefault = prefault
        self._arena: A.Arena | None = None
        self._lock = threading.Lock()

    def get(self, slot: A.Slot) -> A.Arena:
        with self._lock:
            a = self._arena
            if a is None or a.id != slot.arena:
                try:
                    new = A.Arena.open(self.spool, private=True)
                except A.ArenaError as e:
                    raise SlotNotReadable(str(e)) from e
                if a is not None:  # its fd only: a worker may be reading the old mapping now, views may live
                    os.close(a._fd)
                    if a.reads is not None:
                        a.reads.close()  # no new holds; its description goes with the last one
                self._arena = a = new
            if a.id != slot.arena:
                raise SlotNotReadable(f"slot of arena {slot.arena}, the spool's arena is {a.id}")
            try:
                a.check(slot)
            except A.ArenaError as e:
                raise SlotNotReadable(str(e)) from e
            if self.prefault:
                a.prefault_ahead(slot)  # in the background: the next slots' first reads pay no faults
            return a

    def close(self) -> None:
        with self._lock:
            if self._arena is not None:
                self._arena.close()  # the mapping itself goes with the last view of it
                self._arena = None


def slot_is_copied(device: torch.device | None, pin_memory: bool) -> bool:
    """Whether a slot's sample is copied out of the arena at once (into one pinned buffer) rather
    than yielded as views of it: for ``pin_memory``, and for a CUDA device, whose copy cannot DMA
    from the arena (a private mapping is not page-locked: :class:`ArenaMaps`)."""
    return pin_memory or (device is not None and device.type == "cuda")


def read_slot(arena: A.Arena, slot: A.Slot, *, copy_into: Callable[[int], torch.Tensor] | None = None,
              on_release: Callable[[], None] | None = None, on_meta: Callable[[dict[str, str]], None] | None = None,
              timings: dict[str, float] | None = None, on_header: OnHeader | None = None) -> dict:  # fmt: skip
    """A slot's tensors, as views of the arena (zero-copy), or, with ``copy_into`` (a pinned
    buffer's allocator), copied into one buffer at once, so the slot is free as soon as this
    returns. The slot is held (``arena.reads``, a read lock on its bytes) before its header is
    read, so what is checked is what the views see for as long as they live: no void, no new
    assignment, no writer gets in meanwhile. A slot this reader cannot hold (write-locked: the
    delivery is stale; the arena replaced) is :class:`SlotNotReadable`. Its size comes from its
    header (``arena.written_size``: a slot not completely written is an :class:`InvalidSample`),
    its tensors from the contract's one parser (every malformed header an
    :class:`InvalidSample`); ``on_meta`` sees the header's metadata before any tensor is made (the
    stream checks that the header's notice is the delivered one). The hold is let go once no view
    is left (a finalizer on the numpy array under every view), then ``on_release`` is called, from
    any thread (it must only queue); at once for a copy or a slot refused here. ``timings``:
    ``read_s`` (parsing, and the copy if any)."""
    t0 = time.perf_counter()
    reads = arena.reads
    if reads is None:
        raise SlotNotReadable("the arena is not mapped for reading (open it private)")
    try:
        reads.take(slot)
    except A.ArenaError as e:
        raise SlotNotReadable(str(e)) from e
    held = True  # until a finalizer owns the hold

    def let_go() -> None:
        nonlocal held
        if held:
            held = False
            reads.release(slot, scrub=False)
            if on_release is not None:
                on_release()

    try:
        mv = memoryview(arena.map)[slot.offset : slot.offset + A.SLOT_HEADER]
        try:
            head = bytes(mv)
        finally:
            mv.release()
        size = A.written_size(head, slot.length)
        arr = np.frombuffer(arena.map, dtype=np.uint8, count=size, offset=slot.offset)
        if copy_into is not None:
            buf = copy_into(size)
            view = buf.numpy()
            view[:] = arr
            _count(timings, size)
            del arr
            let_go()  # nothing of it was handed out: no private page to drop
            head = view[: A.SLOT_HEADER].tobytes()  # everything from the copy: what is checked is what is used
            A.written_size(head, slot.length)
            base, out_view = buf, view
        else:
            fin = weakref.finalize(arr, _let_go_viewed, reads, slot, on_release)
            fin.atexit = False  # at exit the kernel drops the locks
            held = False
            base, out_view = torch.from_numpy(arr), arr
            del arr
    finally:
        let_go()
    spans, meta = SF.parse_header(head, size, PL.safetensors_itemsizes())
    if on_meta is not None:
        on_meta(meta)
    tensors = {name: base[sp.start : sp.end].view(PL.safetensors_torch_dtype(sp.dtype)).view(sp.shape)
               for name, sp in spans.items()}  # fmt: skip
    del out_view
    if timings is not None:
        timings["read_s"] = time.perf_counter() - t0
    if on_header is not None:
        if copy_into is not None:
            feed = on_header(tensors, {name: (sp.start, sp.end) for name, sp in spans.items()})
            if feed is not None:
                feed(0, size)
        elif (feed := on_header(tensors, None)) is not None:
            feed(0, 0)
    return tensors


def _let_go_viewed(reads: A.SlotReads, slot: A.Slot, on_release: Callable[[], None] | None) -> None:
    """The last view of a slot is gone: its private pages dropped, its hold let go, then the
    caller told (a finalizer: any thread)."""
    reads.release(slot, scrub=True)
    if on_release is not None:
        on_release()


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
                _count(timings, len(payload))  # parsed into new tensors: a copy
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
    _count(timings, size)  # the whole file into the buffer
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


def _count(timings: dict[str, float] | None, nbytes: int) -> None:
    """A copy of ``nbytes`` into host memory, for ``timings["bytes_copied"]`` (the stream's
    ``stats["bytes_copied"]``)."""
    if timings is not None:
        timings["bytes_copied"] = timings.get("bytes_copied", 0) + nbytes


def _tensors_in(buf: torch.Tensor, view: np.ndarray, size: int) -> tuple[dict, dict[str, tuple[int, int]]]:
    """The tensors the header at the start of ``buf`` describes (views of it) and their byte
    spans, by the contract's parser (every malformed header an :class:`InvalidSample`)."""
    hlen = SF.header_length(view[:8].tobytes(), size)
    spans, _ = SF.parse_header(view[: 8 + hlen].tobytes(), size, PL.safetensors_itemsizes())
    out = {name: buf[sp.start : sp.end].view(PL.safetensors_torch_dtype(sp.dtype)).view(sp.shape)
           for name, sp in spans.items()}  # fmt: skip
    return out, {name: (sp.start, sp.end) for name, sp in spans.items()}
