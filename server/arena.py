"""The sidecar's half of the arena layout (``connector/contract/arena.py``): the arena file and
the allocator of its slots.

The ledger owns the slots (a sample's ``slot`` column, so a restart rebuilds the table from
the rows that hold one); this allocator only knows which byte ranges are taken. It runs under
the ledger's lock, so it has no lock of its own.

Policy: first fit at the lowest offset over free ranges kept sorted and merged with their
neighbours on every free, in whole pages. Samples of one job are mostly of similar sizes, so
first fit keeps the low end dense and the largest free range at the top; a sample needs one
contiguous range, so the largest sample that fits is the largest free range
(``largest_free``), at most the arena's size less its header page. A sample that does not fit
waits (admission stops as for a full budget) until enough slots are freed and merged; when the
arena is empty everything merges into one range, so any sample up to the arena's data size is
served eventually and none waits forever.

Who may write a slot (``connector/contract/arena.py``): :meth:`alloc` writes the assignment's
claim into the slot, the connector writes under a lease (a write lock on the slot's bytes) and
only while its claim is there, a trainer reads it under a hold (a read lock on its bytes, from
before its header is read until its last view goes), and every free voids the claim under a
write lock first. A slot that a writer or a reader still holds (an abandoned request whose engine
is still writing; a trainer that went quiet, was dropped or outlived a restart with views of it)
cannot be voided: it stays out of the free list until they let go, and no write of a given-up
assignment starts after its void. So no slot is ever written by two assignments, however late a
writer is, nor while anyone may view it; the trainer trusts a slot's bytes without a checksum
(docs/architecture.md).

A slot given up by a sample that may still be read (its request abandoned, a leased sample
cancelled) goes into quarantine for ``quarantine_s`` after its void before it can be assigned
again: a reader that had its DELIVER and not yet its hold finds another generation in it and
refuses it, and the quarantine keeps even that from happening. A restarted sidecar voids the
claims it finds in its free ranges (assignments the ledger never committed, or voids a crash cut
off) and keeps out of them whatever the kernel says is still locked, by a writer or a reader that
outlived the sidecar: :meth:`void_stale_claims`.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from connector.contract import arena as A

log = logging.getLogger("hsstream.sidecar")


@dataclass
class ArenaStats:
    size: int
    used_bytes: int
    slots: int
    free_bytes: int
    largest_free: int
    quarantined_bytes: int  # given up: waiting out the quarantine, or for their writer or readers to let go
    refused: int


class SlotAllocator:
    def __init__(self, arena_id: str, size: int, *, quarantine_s: float = 60.0, generation: int | None = None,
                 arena: A.Arena | None = None) -> None:  # fmt: skip
        """``arena``: the mapping whose slots are claimed and voided (None: the ranges only, for
        tests of the policy)."""
        self.arena = arena
        self.arena_id = arena_id
        self.size = size
        self.quarantine_s = quarantine_s
        # free ranges (offset, length), sorted by offset, never adjacent (merged)
        self._starts: list[int] = [A.PAGE] if size > A.PAGE else []
        self._lens: list[int] = [size - A.PAGE] if size > A.PAGE else []
        self._taken: dict[int, int] = {}  # offset -> length
        self._quarantine: list[tuple[float, int, int]] = []  # (free at, offset, length)
        # Given up but not voided: a writer or a reader still holds it (slot, quarantined when voided)
        self._held: list[tuple[A.Slot, bool]] = []
        #: Ranges a restart found still locked by a writer or reader (:meth:`void_stale_claims`).
        self.held_at_restart = 0
        # Generations only grow, across restarts too (microseconds since the epoch at start, or
        # past the highest the ledger holds): a late write of an earlier assignment never matches.
        self._generation = max(generation or 0, int(time.time() * 1e6))
        self.refused = 0

    # -------------------------------------------------------------- assignment
    def alloc(self, nbytes: int) -> A.Slot | None:
        """A slot of at least ``nbytes`` (whole pages), or None when no free range is that large."""
        self._thaw()
        need = A.round_up(max(nbytes, A.PAGE))
        for i, ln in enumerate(self._lens):
            if ln >= need:
                off = self._starts[i]
                if ln == need:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i], self._lens[i] = off + need, ln - need
                self._taken[off] = need
                self._generation += 1
                slot = A.Slot(arena=self.arena_id, offset=off, length=need, generation=self._generation)
                if self.arena is not None:
                    self.arena.assign(slot)
                return slot
        self.refused += 1
        return None

    def fits_ever(self, nbytes: int) -> bool:
        """Whether a sample of ``nbytes`` fits the arena at all (when it is empty)."""
        return A.round_up(max(nbytes, A.PAGE)) <= self.size - A.PAGE

    def reserve(self, slot: A.Slot) -> bool:
        """Mark a slot the ledger holds as taken (rebuilding after a restart); False if it is not
        this arena's or overlaps one already taken (the ledger then drops it)."""
        if slot.arena != self.arena_id or slot.end > self.size:
            return False
        i = bisect.bisect_right(self._starts, slot.offset) - 1
        if i < 0 or self._starts[i] + self._lens[i] < slot.end:
            return False  # not inside one free range: taken already
        off, ln = self._starts[i], self._lens[i]
        del self._starts[i], self._lens[i]
        if slot.offset > off:
            self._insert(off, slot.offset - off)
        if slot.end < off + ln:
            self._insert(slot.end, off + ln - slot.end)
        self._taken[slot.offset] = slot.length
        self._generation = max(self._generation, slot.generation)
        return True

    def free(self, slot: A.Slot, *, quarantine: bool = False) -> None:
        """Give a slot back: at once, or after ``quarantine_s`` (see the module's docstring). A
        slot not taken (freed twice, another arena's) is ignored."""
        if slot.arena != self.arena_id or self._taken.get(slot.offset) != slot.length:
            return
        del self._taken[slot.offset]
        if not self._void(slot):
            self._held.append((slot, quarantine))  # its writer or a reader is still at it: voided later (_thaw)
            return
        self._release(slot, quarantine)

    def _void(self, slot: A.Slot) -> bool:
        """The claim voided (:meth:`~connector.contract.arena.Arena.void`); False while a writer
        or a reader holds the slot, or when the lock cannot be taken at all (kept, tried again
        later)."""
        if self.arena is None:
            return True
        try:
            return self.arena.void(slot)
        except A.ArenaError as e:
            log.warning("slot %d+%d kept out of the free list: %s", slot.offset, slot.length, e)
            return False

    def _release(self, slot: A.Slot, quarantine: bool) -> None:
        if quarantine and self.quarantine_s > 0:
            self._quarantine.append((time.monotonic() + self.quarantine_s, slot.offset, slot.length))
        else:
            self._merge_in(slot.offset, slot.length)

    def void_stale_claims(self) -> int:
        """After a restart, once the ledger's slots are reserved: void the claims left in free
        ranges (assignments the ledger never committed, or a void a crash cut off), and keep out
        of the free list every part of them a writer or a reader still holds (the kernel's locks:
        a writer still writing, a trainer still viewing a slot the ledger gave up), until it lets
        go. The sidecar keeps no record of who holds what: the locks are the record, and they
        outlive it. Returns the claims found."""
        if self.arena is None:
            return 0
        found = 0
        for off in A.claimed_pages(self.arena.map):
            i = bisect.bisect_right(self._starts, off) - 1
            if i < 0 or self._starts[i] + self._lens[i] < off + A.PAGE:
                continue  # a taken slot's own claim
            found += 1
            if not self._void(A.Slot(arena=self.arena_id, offset=off, length=A.PAGE, generation=1)):
                self._keep_held(off, self._starts[i] + self._lens[i])  # its writer outlived the sidecar
        for start, length in list(zip(self._starts, self._lens, strict=True)):
            self._keep_held(start, start + length)
        if found:
            log.info("voided %d claim(s) of slots the ledger does not hold", found)
        if self.held_at_restart:
            log.info("%d range(s) of the arena still held by a writer or a trainer: kept out until they let go",
                     self.held_at_restart)  # fmt: skip
        return found

    def _keep_held(self, start: int, end: int) -> None:
        """The parts of the free range ``[start, end)`` a writer or a reader holds, out of the
        free list until they can be voided (:meth:`_thaw`)."""
        assert self.arena is not None
        for at, n in self.arena.held_ranges(start, end):
            kept = A.Slot(arena=self.arena_id, offset=at, length=n, generation=1)
            if self.reserve(kept):
                del self._taken[at]
                self._held.append((kept, False))
                self.held_at_restart += 1

    # -------------------------------------------------------------- free list
    def _thaw(self) -> None:
        if self._held:
            held, self._held = self._held, []
            for slot, quarantine in held:
                if self._void(slot):
                    self._release(slot, quarantine)
                else:
                    self._held.append((slot, quarantine))
        if not self._quarantine:
            return
        now = time.monotonic()
        keep = []
        for due, off, ln in self._quarantine:
            if due <= now:
                self._merge_in(off, ln)
            else:
                keep.append((due, off, ln))
        self._quarantine = keep

    def _insert(self, off: int, ln: int) -> None:
        i = bisect.bisect_left(self._starts, off)
        self._starts.insert(i, off)
        self._lens.insert(i, ln)

    def _merge_in(self, off: int, ln: int) -> None:
        i = bisect.bisect_left(self._starts, off)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == off:  # joins the range before
            i -= 1
            self._lens[i] += ln
        else:
            self._starts.insert(i, off)
            self._lens.insert(i, ln)
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
            self._lens[i] += self._lens[i + 1]
            del self._starts[i + 1], self._lens[i + 1]

    def stats(self) -> ArenaStats:
        self._thaw()
        return ArenaStats(
            size=self.size, used_bytes=sum(self._taken.values()), slots=len(self._taken),
            free_bytes=sum(self._lens), largest_free=max(self._lens, default=0),
            quarantined_bytes=sum(q[2] for q in self._quarantine) + sum(w[0].length for w in self._held),
            refused=self.refused,
        )  # fmt: skip


def open_arena(spool: Path, size: int) -> tuple[A.Arena, bool]:
    """The spool's arena for a budget of ``size`` bytes: the one already there when it has that
    size (its slots in the ledger stay valid across a sidecar restart), else a new one. Returns
    (arena, reused). Leftovers of a creation that was killed half-way are removed."""
    for e in os.scandir(spool):
        if e.name.startswith(A.ARENA_NAME + ".") and e.name.endswith(".new"):
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass
    old = A.Arena.open_existing(spool, size)
    if old is not None:
        try:
            old.reserve()  # an arena an older sidecar left sparse
        except BaseException:
            old.close()
            raise
        old.prefault()  # zeroes what reserve() just allocated; maps the rest (cheap)
        return old, True
    log.info("creating the arena %s (%d MiB)", spool / A.ARENA_NAME, size >> 20)
    arena = A.Arena.create(spool, size)
    # The pages' first touch zeroes them (fallocate only reserves them): done here, in the
    # background, rather than in the connector's first write of each slot.
    arena.prefault()
    return arena, False
