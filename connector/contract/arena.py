"""The arena spool layout: one shared-memory region per spool, one slot per sample.

With ``HSSTREAM_SPOOL_LAYOUT=arena`` the sidecar creates one file, :data:`ARENA_NAME` in the
spool directory (tmpfs: shared memory), sized by the spool budget, and assigns every sample it
can price a *slot* of it at submission (:class:`Slot`, in the request's ``kv_transfer_params``).
The connector maps the file once per process and writes the sample into its slot; the trainer
maps it once and yields views of the slot: no file is created, read, renamed or unlinked per
sample. Drop-in clients (plain vLLM requests) never see a slot: they get files as before.

A slot holds exactly what a sample file holds, in safetensors' own layout (8-byte header
length, JSON header, data), so the contract's one header parser (``sample_file.parse_header``)
and checksum rules apply unchanged; only the header is padded with spaces to
:data:`SLOT_HEADER` bytes, so the data starts at a fixed, page-aligned place the connector can
copy into before it knows the header (the checksum goes into the header, written last). The
tensors are in safetensors' order (largest item size first, then by name), so every tensor's
bytes are aligned to its item size.

The slot's life: assigned (sidecar, in the ledger; its claim written into the slot,
:meth:`Arena.assign`) → written (connector, under its :class:`SlotLease`: the slot's bytes
locked, the claim checked, the data copied in, the header written last, the lease released) →
READY on its notice → read in place by a trainer, under its read hold (:class:`SlotReads`: a
read lock on the slot's bytes, taken before the header is read, held while any view of the slot
is alive) → freed when the trainer says RECEIVED, which it sends only once no view of the slot
is left; every free voids the claim under the slot's write lock first (:meth:`Arena.void`). Each
assignment has a new ``generation``. A writer whose claim was voided is refused before it writes
a byte, and a slot that a writer or any reader still holds cannot be voided (the write lock
conflicts with both), so no two assignments ever write one slot and no slot is written again
while anyone may view it: the trainer trusts a slot read in place without a checksum. The locks
are the kernel's (open-file-description locks): they go with a killed process, and they outlive
the sidecar, so a restarted sidecar learns what is still held by asking for them
(:meth:`Arena.held_ranges`). The notice inside the slot's header carries the generation too,
and a trainer refuses a slot whose header names another than its DELIVER. The arena's first page
names the arena (``arena`` id, a random hex string made at creation), so a slot of another arena
(the sidecar made a new one) is refused instead of read.

A trainer maps the arena copy-on-write (``MAP_PRIVATE``, :meth:`Arena.open` ``private``): an
in-place op on a yielded tensor (an ``add_``, a normalisation) changes a private copy of the
page, never the shared slot, and when the slot's last view goes its private pages are dropped
(:class:`SlotReads`), so the next sample in those bytes is read from the arena again. Not a
read-only mapping: torch ignores numpy's read-only flag, and an in-place op would SIGSEGV.

Importable without torch (the writer and the readers import it where they need tensors).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import json
import mmap
import os
import queue
import secrets
import struct
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from connector.contract.errors import ProtocolError
from connector.contract.sample_file import InvalidSample

#: The arena's file in the spool directory: a dot name, never one of the connector's sample
#: names, so the reaper and every "spool is empty" count leave it alone.
ARENA_NAME = ".hsstream-arena"
#: Allocation unit and alignment of slots (and of the arena's own header).
PAGE = 4096
#: Bytes at a slot's start for the safetensors header length and header; the data follows.
SLOT_HEADER = 4096
#: The arena's first page: magic, format version, size, id (JSON after the magic).
ARENA_MAGIC = b"HSSARENA"
#: 2: slots are claimed by the sidecar and written under a lease (SlotLease); 3: read under a
#: read hold (SlotReads) from a copy-on-write mapping, so an older trainer (no holds, a shared
#: writable mapping) cannot open it.
ARENA_FORMAT = 3
#: The smallest arena worth making (one page of header, one of data).
MIN_ARENA_BYTES = 2 * PAGE
#: ``madvise(2)`` advice (Linux 5.14+) that fills this process's page tables for a range ahead
#: of use. A process's first touch of a slot otherwise faults its pages in a few at a time, even
#: though another process wrote them (docs/benchmarks.md, the arena's page tables). The read
#: advice, not the write one: on tmpfs (no dirty tracking) it maps the pages writable too, so the
#: connector's writes take no faults either, and it maps 16 pages per fault where the write
#: advice maps one (a third of the cost: docs/benchmarks.md).
MADV_POPULATE_READ = 22
#: Bytes per ``madvise`` call of :meth:`Arena.prefault`: a close stops it within one of these,
#: and the mapping's lock is held for no longer than one of these takes.
PREFAULT_CHUNK = 16 << 20
#: How far past a slot in use :meth:`Arena.prefault_ahead` maps, in slots of its length: more
#: than a trainer's credit and the samples a connector writes at once, so the slots assigned
#: next (first fit: the next ones up) are mapped before their turn.
PREFAULT_AHEAD_SLOTS = 16
#: A slot's claim (:meth:`Arena.assign`), in its header room right after the header length:
#: the magic and the assignment's generation. Only the writer of that generation may write the
#: slot, once: its header, written last, replaces the claim.
CLAIM_MAGIC = b"HSSCLAIM"
CLAIM_AT = 8
CLAIM_LEN = len(CLAIM_MAGIC) + 8
#: How long a writer waits for its slot's lock (held only by a writer of an overlapping, older
#: assignment still writing, or by the sidecar for the moment it takes to void a claim).
LEASE_WAIT_S = 10.0
#: How long a reader waits for a slot's read lock. A write lock on a delivered slot is held only
#: while the sidecar voids it or a writer of a newer assignment writes it: the delivery is stale.
READ_WAIT_S = 0.5
#: ``madvise(2)``: drop a range's pages from this process's page tables; in a private mapping its
#: private copies are discarded and the next touch reads the file again.
MADV_DONTNEED = 4
#: ``/proc/self/pagemap`` entry bits: page present, swapped, file-backed (or shared).
_PM_PRESENT, _PM_SWAPPED, _PM_FILE = 1 << 63, 1 << 62, 1 << 61


class ArenaError(ProtocolError):
    """An arena or slot that cannot be used (wrong arena, out of bounds, unreadable header)."""


class SlotReassigned(ArenaError):
    """The slot does not hold this writer's claim: its assignment was given up (the sample timed
    out, its engine was marked down, the sidecar restarted) and the bytes may be another
    sample's. The write is refused before a byte is written."""


class SlotBusy(ArenaError):
    """The slot's lock stayed held past :data:`LEASE_WAIT_S` (a writer of an overlapping, older
    assignment is still writing)."""


#: ``struct flock`` on Linux x86-64 and aarch64: l_type, l_whence, l_start, l_len, l_pid (0 for
#: OFD locks), with the C struct's padding.
_FLOCK = "hhxxxxqqixxxx"


def _flock(kind: int, start: int, length: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0)


def claim_bytes(generation: int) -> bytes:
    return CLAIM_MAGIC + generation.to_bytes(8, "little")


def _ofd_lock(fd: int, kind: int, start: int, length: int) -> bool:
    """An open-file-description lock (``F_OFD_SETLK``) on ``[start, start + length)`` of ``fd``,
    without waiting: True if taken (or released, for ``F_UNLCK``), False if another description
    holds a conflicting one. OFD locks, not POSIX record locks: two descriptions in one process
    (a late writer and a new one in the same vLLM worker) exclude each other, and the kernel drops
    a description's locks when its last descriptor closes, a killed process's included."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(kind, start, length))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


class SlotLease:
    """A writer's exclusive hold on one slot, from before its first byte is written until after
    its header (:meth:`Arena.lease`): a write lock on the slot's bytes in a description of the
    arena file of its own. While it is held the sidecar cannot void the slot's claim, so the slot
    cannot be given to anyone else; once the claim is void, no lease of that assignment is ever
    granted again. :meth:`release` is idempotent; a killed writer's lease goes with its process
    (with its last descriptor of the description: a child forked meanwhile holds one too, which
    is why :meth:`release` unlocks before it closes)."""

    def __init__(self, fd: int, slot: Slot) -> None:
        self._fd: int | None = fd
        self.slot = slot

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            _ofd_lock(fd, fcntl.F_UNLCK, self.slot.offset, self.slot.length)  # a forked child's copy too
        except OSError:
            pass  # closing drops it anyway once no other descriptor of the description is left
        finally:
            os.close(fd)


class SlotReads:
    """A reader's holds on the slots it views (a trainer's, ``trainer_client/sample_reader.py``):
    a read lock (``F_OFD_SETLK``, ``F_RDLCK``) over each slot's bytes, on one description of the
    arena file of its own, from before the slot's header is read until its last view goes. The
    sidecar's void takes a write lock, so it fails while any reader holds the slot, which stays
    out of the free list; the lock is the kernel's, so it survives a sidecar restart (the new one
    finds it, :meth:`Arena.held_ranges`) and goes with a killed reader.

    Holds are counted per slot; one description's locks merge, so letting go of a slot unlocks
    only the bytes no other hold of this reader covers (a slot read twice, a stale delivery of an
    overlapping one). Letting go first drops this process's private copies of the slot's pages
    (copy-on-write mapping: what an in-place op on a view wrote), found in ``/proc/self/pagemap``,
    so the next sample in those bytes is read from the arena, not from them.

    :meth:`release` may run in any thread, in a finalizer, even one the garbage collector runs in
    the middle of :meth:`take` on the same thread: it only queues, and whoever holds the
    bookkeeping lock (or takes it next) applies the queue. A process forked from the reader
    (which inherits the description) never lets go of the parent's holds."""

    def __init__(self, arena: Arena) -> None:
        self._fd: int | None = arena._description()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: queue.SimpleQueue[tuple[int, int, bool]] = queue.SimpleQueue()
        self._held: dict[tuple[int, int], int] = {}  # (offset, length) -> holds
        self._order: list[tuple[int, int]] = []  # the held ranges, sorted
        self._longest = 0
        self._closed = False
        # An export of the mapping while the reader is open: its pages stay mapped for the scrub.
        self._buf: Any = (ctypes.c_char * arena.size).from_buffer(arena.map) if arena.private else None
        self._base = ctypes.addressof(self._buf) if self._buf is not None else 0
        self._pagemap: int | None = None
        if arena.private:
            try:
                self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._pagemap = None  # every page of a slot let go is dropped then (slower, as safe)
        self.scrubbed_pages = 0  # private pages dropped so far (an in-place op wrote them)

    def take(self, slot: Slot, wait_s: float = READ_WAIT_S) -> None:
        """Hold ``slot`` (its bytes read-locked). :class:`SlotBusy` when a write lock stays on
        them for ``wait_s`` (the delivery is stale: the slot is being voided or written anew),
        :class:`ArenaError` when this reader is closed (its arena was replaced)."""
        key = (slot.offset, slot.length)
        deadline, pause = time.monotonic() + wait_s, 0.0005
        while True:
            with self._lock:
                if self._closed or self._fd is None:
                    raise ArenaError("the arena was replaced (this mapping is closed)")
                n = self._held.get(key, 0)
                got = n > 0 or _ofd_lock(self._fd, fcntl.F_RDLCK, slot.offset, slot.length)
                if got:
                    self._held[key] = n + 1
                    if n == 0:
                        bisect.insort(self._order, key)
                        self._longest = max(self._longest, slot.length)
            self._apply()
            if got:
                return
            if time.monotonic() >= deadline:
                raise SlotBusy(f"slot {slot.offset}+{slot.length} is write-locked (voided or written anew): "
                               "a stale delivery")  # fmt: skip
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def release(self, slot: Slot, *, scrub: bool = True) -> None:
        """Let go of one hold of ``slot`` (any thread; see the class). ``scrub``: views of it were
        handed out, so an in-place op may have written private copies of its pages."""
        if os.getpid() != self._pid:
            return  # a forked child's copy: the holds are the parent's
        self._pending.put((slot.offset, slot.length, scrub))
        self._apply()

    def holds(self) -> int:
        """Slots held now."""
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        """No new holds; the description goes once the last hold is let go (its locks with it)."""
        with self._lock:
            self._closed = True
            if not self._held:
                self._shut()
        self._apply()

    def _apply(self) -> None:
        while not self._pending.empty():
            if not self._lock.acquire(blocking=False):
                return  # its holder applies the queue when it lets go of the lock
            try:
                while True:
                    try:
                        off, length, scrub = self._pending.get_nowait()
                    except queue.Empty:
                        break
                    self._let_go(off, length, scrub)
            finally:
                self._lock.release()

    def _let_go(self, off: int, length: int, scrub: bool) -> None:
        key = (off, length)
        n = self._held.get(key, 0)
        if n > 1:
            self._held[key] = n - 1
            return
        if n == 0:
            return
        del self._held[key]
        del self._order[bisect.bisect_left(self._order, key)]
        for a, b in self._uncovered(off, off + length):
            try:
                if scrub:
                    self.scrub(a, b)
                if self._fd is not None:
                    _ofd_lock(self._fd, fcntl.F_UNLCK, a, b - a)
            except OSError:
                pass  # closing the description drops the lock anyway
        if self._closed and not self._held:
            self._shut()

    def _uncovered(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of [lo, hi) no other held range covers."""
        i = bisect.bisect_left(self._order, (lo - self._longest, 0))
        parts, at = [], lo
        for start, length in self._order[i:]:
            if start >= hi:
                break
            end = start + length
            if end <= at:
                continue
            if start > at:
                parts.append((at, start))
            at = max(at, end)
            if at >= hi:
                break
        if at < hi:
            parts.append((at, hi))
        return parts

    def scrub(self, a: int, b: int) -> None:
        """Drop this process's private copies of the pages of [a, b) (an in-place op wrote them):
        the pages that are present and not the file's, or swapped out; all of them if the page
        map cannot be read."""
        if self._buf is None:
            return
        first, n = (self._base + a) // PAGE, (b - a) // PAGE
        runs: list[tuple[int, int]] = [(0, n)]
        if self._pagemap is not None:
            import numpy as np

            try:
                raw = os.pread(self._pagemap, 8 * n, 8 * first)
            except OSError:
                raw = b""
            if len(raw) == 8 * n:
                e = np.frombuffer(raw, dtype="<u8")
                own = ((e & np.uint64(_PM_PRESENT | _PM_FILE)) == np.uint64(_PM_PRESENT)) | (
                    (e & np.uint64(_PM_SWAPPED)) != 0)
                if not own.any():
                    return
                idx = np.flatnonzero(own)
                cut = np.flatnonzero(np.diff(idx) != 1)
                starts = np.concatenate(([idx[0]], idx[cut + 1]))
                ends = np.concatenate((idx[cut], [idx[-1]])) + 1
                runs = list(zip(starts.tolist(), ends.tolist(), strict=True))
        libc = _libc()
        for i, j in runs:
            if libc.madvise(ctypes.c_void_p(self._base + a + i * PAGE), ctypes.c_size_t((j - i) * PAGE),
                            MADV_DONTNEED) != 0:  # fmt: skip
                raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of a slot's private pages")
            self.scrubbed_pages += j - i

    def _shut(self) -> None:
        for fd in (self._fd, self._pagemap):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._pagemap = None
        self._buf = None


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def claimed_pages(mapped: mmap.mmap) -> list[int]:
    """Offsets of the pages that hold a claim (a slot assigned and not yet written, or an
    assignment whose claim a crash left behind): what a restarted sidecar voids in its free
    ranges (``server/arena.py``)."""
    import numpy as np

    words = np.frombuffer(mapped, dtype="<u8", count=len(mapped) // PAGE * (PAGE // 8))
    at_claims = words[CLAIM_AT // 8 :: PAGE // 8]  # one word per page: no copy of the arena
    hits = np.flatnonzero(at_claims == int.from_bytes(CLAIM_MAGIC, "little"))
    return [int(i) * PAGE for i in hits if i > 0]  # page 0 is the arena's own header


def _lock_holder(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """The byte range of a write lock another description holds over ``[start, start + length)``
    (``F_OFD_GETLK``), or None; a length of 0 means "to the end of the file"."""
    kind, _, at, n, _ = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, start, length)))
    return None if kind == fcntl.F_UNLCK else (at, n)


def round_up(n: int, unit: int = PAGE) -> int:
    return -(-n // unit) * unit


def slot_length(data_bytes: int) -> int:
    """The slot a sample of ``data_bytes`` tensor bytes needs: the header's room plus the data,
    in whole pages."""
    return round_up(SLOT_HEADER + max(0, data_bytes))


class Slot(BaseModel):
    """Where one sample's bytes go in the arena (sidecar → vLLM in ``kv_transfer_params``,
    connector → sidecar in the notice, sidecar → trainer in the DELIVER)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arena: str = Field(pattern=r"^[0-9a-f]{16,64}$")
    offset: int = Field(ge=PAGE, multiple_of=PAGE)
    length: int = Field(ge=PAGE, multiple_of=PAGE, le=1 << 40)
    generation: int = Field(ge=1)

    @property
    def end(self) -> int:
        return self.offset + self.length


def header_for(specs: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A slot's safetensors header for tensors ``(name, safetensors dtype, shape, nbytes)``: the
    header bytes (8-byte length + JSON padded with spaces to :data:`SLOT_HEADER`) and each
    tensor's span relative to the data's start. Raises :class:`ArenaError` when the JSON does
    not fit (a very long model name in the notice)."""
    order = sorted(specs, key=lambda s: (-_itemsize(s[1]), s[0]))
    spans: dict[str, tuple[int, int]] = {}
    at = 0
    table: dict[str, Any] = {}
    for name, dtype, shape, nbytes in order:
        spans[name] = (at, at + nbytes)
        table[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    body = json.dumps({"__metadata__": metadata, **table}, separators=(",", ":")).encode()
    room = SLOT_HEADER - 8
    if len(body) > room:
        raise ArenaError(f"sample header of {len(body)} bytes does not fit a slot's {room}")
    return room.to_bytes(8, "little") + body + b" " * (room - len(body)), spans


def data_spans(specs: list[tuple[str, str, list[int], int]]) -> dict[str, tuple[int, int]]:
    """Each tensor's span relative to the data's start, as :func:`header_for` lays them out (the
    connector copies into them before the header exists)."""
    order = sorted(specs, key=lambda s: (-_itemsize(s[1]), s[0]))
    out, at = {}, 0
    for name, _, _, nbytes in order:
        out[name] = (at, at + nbytes)
        at += nbytes
    return out


def written_size(head: bytes | memoryview, capacity: int) -> int:
    """The bytes of the sample written at the start of a slot (header + data), from its header
    (``head``: at least the slot's first :data:`SLOT_HEADER` bytes), at most ``capacity``. A slot
    whose header is not (yet) a complete one of ours is an :class:`~connector.contract.sample_file.InvalidSample`:
    its writer zeroes the header's length first and writes the header last."""
    hlen = int.from_bytes(bytes(head[:8]), "little")
    if hlen != SLOT_HEADER - 8:
        raise InvalidSample(f"slot not (completely) written: header length {hlen}, a slot's is {SLOT_HEADER - 8}")
    try:
        table = json.loads(bytes(head[8:SLOT_HEADER]))
        end = max((e["data_offsets"][1] for k, e in table.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        raise InvalidSample(f"unreadable slot header: {type(e).__name__}") from None
    if type(end) is not int or not 0 <= end <= capacity - SLOT_HEADER:
        raise InvalidSample(f"slot header: data end {end!r} outside the slot's {capacity - SLOT_HEADER} data bytes")
    return SLOT_HEADER + end


_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1}


def _itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ArenaError(f"dtype {dtype!r} cannot be laid out in a slot") from None


class Arena:
    """One process's mapping of the arena file. The sidecar :meth:`create` s it; the connector
    :meth:`open` s it shared (it writes); same-host trainers open it ``private`` (copy-on-write:
    their tensors are views, torch wants writable memory under a tensor, and what they write stays
    theirs), reading each slot under its :attr:`reads` hold."""

    def __init__(self, path: Path, fd: int, size: int, arena_id: str, *, private: bool = False) -> None:
        self.path, self.size, self.id = path, size, arena_id
        self._fd = fd
        self.private = private
        flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        self.map = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.inode = os.fstat(fd).st_ino
        #: Bytes of the mapping :meth:`prefault` has put in the page tables so far, and why it
        #: stopped early (None: it did not, or has not run).
        self.prefaulted = 0
        self.prefault_error: str | None = None
        self._closed = threading.Event()
        self._pf_lock = threading.Lock()
        self._pf_want = 0  # where the prefault runs to
        self._pf_thread: threading.Thread | None = None
        self._void_fd: int | None = None
        #: A trainer's holds on the slots it reads (:class:`SlotReads`); None in a shared mapping.
        self.reads: SlotReads | None = SlotReads(self) if private else None

    @classmethod
    def create(cls, spool: str | os.PathLike[str], size: int, mode: int = 0o600) -> Arena:
        """A new arena of ``size`` bytes (rounded up to pages) in ``spool``, replacing any old
        one atomically (written under a temporary name, then renamed): a process that mapped the
        old one keeps its pages until it notices the new id."""
        size = max(MIN_ARENA_BYTES, round_up(size))
        spool = Path(spool)
        arena_id = secrets.token_hex(16)
        tmp = spool / f"{ARENA_NAME}.{os.getpid()}.new"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            os.ftruncate(fd, size)
            reserve(fd, size, spool)
            head = ARENA_MAGIC + json.dumps({"format": ARENA_FORMAT, "size": size, "id": arena_id}).encode()
            os.pwrite(fd, head.ljust(PAGE, b" "), 0)
            os.rename(tmp, spool / ARENA_NAME)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return cls(spool / ARENA_NAME, fd, size, arena_id)

    @classmethod
    def open(cls, spool: str | os.PathLike[str], *, private: bool = False) -> Arena:
        """The arena the sidecar made in ``spool``; :class:`ArenaError` if there is none or its
        first page is not an arena's. ``private``: a trainer's copy-on-write mapping (see the
        class)."""
        path = Path(spool) / ARENA_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise ArenaError(f"no arena at {path}: {e.strerror or e}") from e
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, PAGE, 0)
            info = _parse_head(head)
            if info["size"] != size:
                raise ArenaError(f"arena {path}: {size} bytes, its header says {info['size']}")
            return cls(path, fd, size, info["id"], private=private)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open_existing(cls, spool: str | os.PathLike[str], size: int) -> Arena | None:
        """The arena already in ``spool`` if it has exactly ``size`` bytes (rounded), else None:
        the sidecar keeps it across its restarts, so READY samples' slots stay valid."""
        try:
            a = cls.open(spool)
        except ArenaError:
            return None
        if a.size != max(MIN_ARENA_BYTES, round_up(size)):
            a.close()
            return None
        return a

    def check(self, slot: Slot) -> None:
        if slot.arena != self.id:
            raise ArenaError(f"slot of arena {slot.arena}, this is {self.id} (the sidecar made a new arena)")
        if slot.end > self.size:
            raise ArenaError(f"slot {slot.offset}+{slot.length} past the arena's {self.size} bytes")

    def view(self, slot: Slot) -> memoryview:
        """The slot's bytes (a view of the shared mapping)."""
        self.check(slot)
        return memoryview(self.map)[slot.offset : slot.end]

    # -- who may write a slot: the claim (sidecar) and the lease (writer) --------------------------
    def assign(self, slot: Slot) -> None:
        """The sidecar's half of a slot's assignment: its header length zeroed ("not written") and
        the claim of its generation after it. No lock is needed: the range was free, so every
        earlier claim in it was voided under its lock (:meth:`void`), and a writer of those
        assignments is refused by its claim however it interleaves with this one."""
        self.check(slot)
        self.map[slot.offset : slot.offset + CLAIM_AT + CLAIM_LEN] = bytes(CLAIM_AT) + claim_bytes(slot.generation)

    def void(self, slot: Slot) -> bool:
        """The sidecar's half of a slot's end: the claim (or a written header) cleared under the
        slot's lock, so no writer of its assignment is writing now or ever will. False, with
        nothing changed, while a writer holds the lock (it is still writing: try again later).
        A claim found with no length known is voided as a one-page slot: every writer's lock
        covers its slot's first page."""
        self.check(slot)
        try:
            fd = self._lock_fd()
            if not _ofd_lock(fd, fcntl.F_WRLCK, slot.offset, slot.length):
                return False
            try:
                self.map[slot.offset : slot.offset + CLAIM_AT + CLAIM_LEN] = bytes(CLAIM_AT + CLAIM_LEN)
            finally:
                _ofd_lock(fd, fcntl.F_UNLCK, slot.offset, slot.length)
        except OSError as e:
            raise ArenaError(f"cannot lock slot {slot.offset}+{slot.length} to void it: {e.strerror or e}") from e
        return True

    def held_ranges(self, start: int, end: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of the parts of ``[start, end)`` that another description holds a
        lock on (``F_OFD_GETLK``): a writer's lease or a reader's hold, sorted, in whole pages. The
        kernel's record of who still uses which bytes, whoever made them: what a restarted sidecar
        keeps out of its free list until they let go. Empty when the locks cannot be asked for."""
        out: list[tuple[int, int]] = []
        todo = [(start, end)]
        try:
            fd = self._lock_fd()
            while todo:
                a, b = todo.pop()
                if a >= b:
                    continue
                got = _lock_holder(fd, a, b - a)  # one conflicting lock, not always the lowest
                if got is None:
                    continue
                at, n = got
                lo = max(a, at - at % PAGE)
                hi = min(b, round_up(self.size if n == 0 else at + n))
                out.append((lo, hi - lo))
                todo += [(a, lo), (hi, b)]
        except (OSError, ArenaError):
            return sorted(out)
        return sorted(out)

    def lease(self, slot: Slot, wait_s: float = LEASE_WAIT_S) -> SlotLease:
        """The writer's hold on ``slot`` (:class:`SlotLease`): its bytes locked in a description
        of the arena file of its own, then its claim checked. Raises :class:`SlotReassigned` when
        the claim is not this assignment's (nothing is written then), :class:`SlotBusy` when the
        lock stays taken for ``wait_s``. The header length is zero from here until the header is
        written last: the assignment zeroed it, and only the header replaces the claim."""
        self.check(slot)
        fd = self._description()
        try:
            deadline, pause = time.monotonic() + wait_s, 0.0005
            while not _ofd_lock(fd, fcntl.F_WRLCK, slot.offset, slot.length):
                if time.monotonic() >= deadline:
                    raise SlotBusy(f"slot {slot.offset}+{slot.length} still locked after {wait_s:g} s "
                                   "(an older writer of these bytes is still writing)")  # fmt: skip
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            if bytes(self.map[slot.offset + CLAIM_AT : slot.offset + CLAIM_AT + CLAIM_LEN]) != claim_bytes(slot.generation):
                raise SlotReassigned(f"slot {slot.offset}+{slot.length} of generation {slot.generation} is no longer "
                                     "claimed for it (given up, and maybe another sample's now): not written")  # fmt: skip
        except OSError as e:
            os.close(fd)
            raise ArenaError(f"cannot lock slot {slot.offset}+{slot.length}: {e.strerror or e}") from e
        except BaseException:
            os.close(fd)
            raise
        return SlotLease(fd, slot)

    def _lock_fd(self) -> int:
        """The sidecar's own description for :meth:`void` (one per mapping, opened at first use)."""
        with self._pf_lock:
            if self._void_fd is None:
                self._void_fd = self._description()
            return self._void_fd

    def _description(self) -> int:
        """A descriptor of an open file description of its own on this arena's file (locks are
        per description), through ``/proc/self/fd`` so it is this mapping's file even after the
        spool's arena was replaced. :class:`ArenaError` if this mapping's descriptor is gone."""
        try:
            fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise ArenaError(f"cannot open the arena again: {e.strerror or e}") from e
        if os.fstat(fd).st_ino != self.inode:  # this mapping's descriptor was closed and its number reused
            os.close(fd)
            raise ArenaError("the arena's descriptor in this process is gone (the arena was replaced)")
        return fd

    def is_current(self) -> bool:
        """Whether the file at :attr:`path` is still the one mapped (not replaced by a new arena)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def reserve(self) -> None:
        """Allocate every page of this arena's file now (:func:`reserve`)."""
        reserve(self._fd, self.size, self.path.parent)

    def prefault(self, upto: int | None = None, *, background: bool = True) -> threading.Thread | None:
        """Fill this process's page tables for the mapping's first ``upto`` bytes (default: all of
        it) with ``MADV_POPULATE_READ``, so no slot there pays page faults on its first read or
        write in this process (they cost more than the slot's checksum: docs/benchmarks.md, the
        arena's page tables). The pages themselves exist already (the sidecar reserved them,
        :func:`reserve`); this maps them, it does not allocate.

        One thread per mapping, from the low end up in :data:`PREFAULT_CHUNK` calls that release
        the GIL; a call with a larger ``upto`` extends its run. ``background`` (default): returns
        at once (the thread, or None when there is nothing to do); a slot used before its turn
        faults as before. Otherwise waits for it. Stops at :meth:`close`. On a kernel without the
        advice (before 5.14) it maps nothing and says why in :attr:`prefault_error`."""
        upto = self.size if upto is None else max(0, min(self.size, round_up(upto)))
        with self._pf_lock:
            if self._closed.is_set() or self.prefault_error is not None:
                self.prefault_error = self.prefault_error or "closed"
                return None
            self._pf_want = max(self._pf_want, upto)
            t = self._pf_thread
            if t is None and self.prefaulted < self._pf_want:
                t = self._pf_thread = threading.Thread(target=self._populate, name="hsstream-arena-prefault",
                                                       daemon=True)  # fmt: skip
                t.start()
        if t is not None and not background:
            t.join()
        return t

    def prefault_ahead(self, slot: Slot) -> None:
        """Map, in the background, from the low end to :data:`PREFAULT_AHEAD_SLOTS` slots of
        ``slot``'s length past it: what a process in the middle of the arena's first pass will
        touch next. Costs in proportion to the part of the arena in use (first fit keeps it at
        the low end), not to the arena's size. Cheap when there is nothing to do (every slot)."""
        if slot.end + PREFAULT_AHEAD_SLOTS * slot.length > self._pf_want:
            self.prefault(slot.end + PREFAULT_AHEAD_SLOTS * slot.length)

    def _populate(self) -> None:
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            # An export of the mapping: it cannot be unmapped under the calls (close() then
            # leaves it to the last user, as with a trainer's live views).
            buf = (ctypes.c_char * self.size).from_buffer(self.map)
        except (OSError, ValueError, TypeError, BufferError) as e:  # closed already, or no libc
            with self._pf_lock:
                self.prefault_error, self._pf_thread = f"{type(e).__name__}: {e}", None
            return
        try:
            base = ctypes.addressof(buf)
            while True:
                with self._pf_lock:
                    if self._closed.is_set():
                        self.prefault_error = "closed"
                    if self.prefault_error is not None or self.prefaulted >= self._pf_want:
                        self._pf_thread = None  # a later, larger prefault() starts another
                        return
                    off = self.prefaulted
                    n = min(PREFAULT_CHUNK, self._pf_want - off)
                if libc.madvise(ctypes.c_void_p(base + off), ctypes.c_size_t(n), MADV_POPULATE_READ) != 0:
                    err = ctypes.get_errno()
                    with self._pf_lock:
                        self.prefault_error = f"madvise: {os.strerror(err)}" + (
                            " (MADV_POPULATE_READ needs Linux 5.14)" if err == errno.EINVAL else "")
                    continue
                self.prefaulted = off + n
        finally:
            del buf
            if self._closed.is_set():
                self._close_map()

    def _close_map(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # views are still alive (a trainer's tensors): the mapping goes with the last one

    def close(self) -> None:
        self._closed.set()
        if self.reads is not None:
            self.reads.close()  # its description goes with the last hold
        self._close_map()
        for fd in (self._fd, self._void_fd):
            try:
                if fd is not None:
                    os.close(fd)
            except OSError:
                pass
        self._void_fd = None


def reserve(fd: int, size: int, where: str | os.PathLike[str] = "") -> None:
    """Allocate every page of an arena file now (``posix_fallocate``): a tmpfs too small for the
    arena fails here, when the sidecar starts, with the figures, instead of a writer dying of
    SIGBUS in the middle of a sample when the tmpfs runs out. The arena holds its whole size of
    shared memory from then on (it would after its first pass over the slots anyway)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        free = ""
        try:
            st = os.fstatvfs(fd)
            free = f"; {st.f_bavail * st.f_frsize >> 20} MiB free there"
        except OSError:
            pass
        raise ArenaError(
            f"cannot reserve the arena's {size >> 20} MiB of shared memory in {where or 'the spool'}: "
            f"{e.strerror or e}{free}. Lower the spool budget (HSSTREAM_SPOOL_BUDGET_BYTES) or enlarge the tmpfs"
        ) from e


def clear_cuda_error() -> None:
    """Reset this thread's CUDA error after a refused ``cudaHostRegister`` (torch's binding has
    no ``cudaGetLastError``): left set, the next kernel launch would raise it. A file mapping
    outside tmpfs is refused (the kernel does not pin such pages for long), so this happens."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _parse_head(head: bytes) -> dict[str, Any]:
    if not head.startswith(ARENA_MAGIC):
        raise ArenaError("not an arena (bad magic)")
    try:
        info = json.loads(head[len(ARENA_MAGIC) :].rstrip(b" \x00"))
    except ValueError as e:
        raise ArenaError(f"unreadable arena header: {e}") from None
    if not isinstance(info, dict) or info.get("format") != ARENA_FORMAT:
        raise ArenaError(f"arena format {info.get('format') if isinstance(info, dict) else info!r}, "
                         f"this build reads {ARENA_FORMAT}")  # fmt: skip
    if type(info.get("size")) is not int or not isinstance(info.get("id"), str):
        raise ArenaError("arena header without size or id")
    return info
