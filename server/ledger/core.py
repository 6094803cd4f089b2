"""The ledger's state and the moves every side shares: write a sample through, queue it again,
retry or finish it, make it READY; and the recovery after a restart.

One lock (``_lock``, re-entrant) guards everything here and in the other parts of the ledger;
each public call takes it, so each move is checked against the current state and attempt (a
late notice for an old attempt cannot resurrect a sample; a second ack cannot count twice).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING
from pathlib import Path

from connector import layouts as L
from connector import protocol as P
from connector.contract.arena import Slot
from server.ledger.budget import SpoolBudget
from server.ledger.rows import Job, SampleRow
from server.ledger.states import IN_FLIGHT, State, check_transition
from server.ledger.store import COLS, Store, row_to_sample

if TYPE_CHECKING:  # the allocator is handed in by server/app.py: the ledger imports none of the sidecar
    from server.arena import ArenaStats, SlotAllocator

#: Most messages a thread applies in one :meth:`LedgerCore.group` (the notices read together, a
#: trainer socket's messages of one poll): the lock is held from the first to the commit, so this
#: bounds how long any other thread waits for it.
GROUP_MAX = 256
#: In a job's meta while its rows are being written: a job still so marked at restart is dropped.
ADMITTING = "admitting"

#: A listener hears (new state, old state or None for a new sample, how many samples, their
#: tokens), on the thread that made the move, with the ledger's lock held: it must be quick and
#: must not call back into the ledger's writes.
Listener = Callable[[State, "State | None", int, int], None]


class LedgerCore:
    def __init__(self, path: str | Path | None = None, max_attempts: int = 3) -> None:
        self.max_attempts = max_attempts
        self.jobs: dict[str, Job] = {}  # jobs not yet compacted
        self._lock = threading.RLock()
        self._live: dict[P.SampleKey, SampleRow] = {}  # SUBMITTED / READY / LEASED
        # READY samples per job, oldest first; may hold samples that left READY (skipped when
        # met). Per job, so a trainer asking for one job never walks another job's samples.
        self._ready: dict[str, deque[SampleRow]] = {}
        self._n_ready = 0
        self._qlo = self._qhi = 0  # queue positions: appendleft below qlo, append above qhi
        self._spool = SpoolBudget()
        #: Spool bytes trainers hold at or over their share of the budget (set by the delivery
        #: thread each pass): the budget's watermark leaves them out (``SpoolBudget.closed``).
        self.pinned_bytes = 0
        #: A sample's spool bytes as known now (the submitter's, from the sample size it learned):
        #: a sample going back to the queue for another attempt is priced again with it, since its
        #: price may be what failed it (an arena slot priced by a config's dtype, not vLLM's).
        self.pricer: Callable[[SampleRow], int | None] | None = None
        self.repriced_refusals = 0  # arena slots refused as priced too small, sent again at the right price
        self._store = Store(path)
        self.path = self._store.path
        #: Told every move as it is written (``Listener``): observers such as the metrics and
        #: the submitter's count of SUBMITTED samples. No thread is woken through them; the
        #: hand-offs between threads are explicit where they happen (see ``server/app.py``).
        self.listeners: list[Listener] = []
        self._deferred: list[tuple] | None = None  # listener events held back until a commit
        #: The arena layout's allocator (``server/arena.py``), None with files: samples get a
        #: slot at submission and give it back in :meth:`_save` when their bytes are free.
        self._slots: SlotAllocator | None = None
        #: Slots of samples acked before their RECEIVED (the trainer asked past a sample it still
        #: holds views of): key -> (slot, trainer, lease token), kept until that RECEIVED or until
        #: the trainer is gone, and on disk in the row's ``slot`` meanwhile (a restart quarantines them).
        self._consumed_slots: dict[P.SampleKey, tuple[Slot, bytes, str]] = {}
        #: Slots given back inside :meth:`ack_many`'s transaction: freed once it is applied (its
        #: savepoint released inside a delivery group), so a rollback leaves each where it was (its
        #: sample still names it, no one else holds it); a failed group commit after that is
        #: reconciled by :meth:`recover` at the next start, as after a crash.
        self._pending_frees: list[tuple[Slot, bool]] | None = None
        #: Slots given back inside a transaction, or while rows wait for the volume (the store is
        #: degraded): freed once what gave them back is on disk (``Store.on_saved``). A slot
        #: freed earlier could be assigned again while the rows on disk still give it to the
        #: sample that had it, which a restart would then deliver with another sample's bytes.
        self._frees_when_saved: list[tuple[Slot, bool]] = []
        self._store.on_saved = self._free_held_back

    # The connection, for the parts' own queries (tests swap it for a wrapper that fails writes).
    @property
    def _db(self):  # noqa: ANN202
        return self._store.db

    @_db.setter
    def _db(self, db) -> None:  # noqa: ANN001
        self._store.db = db

    @property
    def reserved_bytes(self) -> int:
        """Spool bytes held: see :mod:`server.ledger.budget`."""
        return self._spool.reserved

    @reserved_bytes.setter
    def reserved_bytes(self, n: int) -> None:
        self._spool.reserved = n

    def is_open(self) -> bool:
        with self._lock:
            return self._store.is_open()

    def try_lock(self) -> bool:
        """Take the ledger's lock if no other thread holds it (``server/ledger_calls.py``)."""
        return self._lock.acquire(blocking=False)

    def unlock(self) -> None:
        self._lock.release()

    @property
    def degraded(self) -> bool:
        """The volume refused writes that memory has made: they wait (``Store.unsaved``), nothing
        new is submitted or leased, and no file or slot they would free is freed, until
        :meth:`flush` writes them."""
        return self._store.degraded

    def unsaved(self) -> tuple[int, float | None, str | None]:
        """Rows waiting for the volume, since when (``time.time()``), and the volume's last error."""
        st = self._store
        return len(st.unsaved), st.unsaved_since, st.last_error

    def flush(self) -> bool:
        """Try to write the rows that wait (the delivery thread calls it while degraded); True
        when none waits. Never waits for the lock: False when another thread holds it."""
        if not self._store.degraded:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._store.flush()
        finally:
            self._lock.release()

    def _free_held_back(self) -> None:
        frees, self._frees_when_saved = self._frees_when_saved, []
        for slot, quarantine in frees:
            self._free_slot(slot, quarantine=quarantine)

    def close(self) -> None:
        with self._lock:
            self._store.close()

    def _tx(self):  # noqa: ANN202
        return self._store.tx()

    @contextmanager
    def group(self):  # noqa: ANN201
        """Several transitions, one commit: the lock is held from the first to the commit, so
        nothing outside the group sees a state SQLite does not hold yet (REST reads take the
        lock too). On an error part-way, what was applied is committed (as if each transition
        had committed alone, which is what happens outside a group) and the error propagates.
        A group inside a transaction joins it."""
        with self._lock, self._store.group():
            yield

    # ------------------------------------------------------------------ one sample
    def get(self, key: P.SampleKey) -> SampleRow | None:
        """The sample in flight, or a copy loaded from SQLite (changes to it must be saved)."""
        if key.job not in self.jobs:
            return None
        return self._live.get(key) or self._store.load(key)

    def _get_many(self, keys: list[P.SampleKey]) -> dict[P.SampleKey, SampleRow]:
        """:meth:`get` for several keys: those in flight from memory, the rest in one query."""
        out = {k: s for k in keys if (s := self._live.get(k)) is not None}
        ask = [k for k in keys if k not in out and k.job in self.jobs]
        if ask:
            out.update(self._store.load_many(ask))
        return out

    def _save(self, s: SampleRow) -> None:
        """Write a sample through, move it between RAM and SQLite-only, and keep the counts."""
        old = s.saved
        check_transition(old, s.state)
        given_back = self._give_back_slot(s, old) if s.slot is not None else None
        self._store.save_sample(s)
        if given_back is not None:  # after the write that says so (held back while it is not on disk)
            self._free_slot(given_back[0], quarantine=given_back[1])
        if s.state in IN_FLIGHT:
            self._live[s.key] = s
        else:
            self._live.pop(s.key, None)
        if old == s.state:
            return
        s.saved = s.state
        self._n_ready += (s.state == State.ready) - (old == State.ready)
        job = self.jobs.get(s.key.job)
        if job is not None:
            if old is not None:
                job.state_counts[old.value] -= 1
            job.state_counts[s.state.value] += 1
        if self._deferred is not None:  # inside ack_many / lease_many: heard only once it commits
            self._deferred.append((s.state, old, 1, len(s.token_ids)))
            return
        self._tell(s.state, old, 1, len(s.token_ids))

    def _give_back_slot(self, s: SampleRow, old: State | None) -> tuple[Slot, bool] | None:
        """Where a sample's slot is given back as its state moves: when it leaves flight (QUEUED
        again or finished), or its bytes were freed while in flight (the trainer's RECEIVED, a
        lost copy). Given back from SUBMITTED (a writer may still write) or LEASED (a trainer may
        still read) without the trainer's RECEIVED, it goes into quarantine. The notice, FAIL and
        lapsed-ACK paths give theirs back before the move, always quarantined; every free goes
        through :meth:`_free_slot`. Returns (slot, quarantine) for the caller to free once the
        row is written (None: kept)."""
        if s.state == State.consumed and s.key in self._consumed_slots:
            return None  # its trainer may still read it: given back on its RECEIVED (``Leases.received``)
        leaving = s.state not in IN_FLIGHT
        freed = s.state in (State.ready, State.leased) and s.on_disk_bytes == 0
        if not (leaving or freed):
            return None
        slot, s.slot = s.slot, None
        return slot, leaving and old in (State.submitted, State.leased)  # type: ignore[return-value]

    def _free_slot(self, slot: Slot, *, quarantine: bool) -> None:
        """Into the allocator now; when the transaction of :meth:`ack_many` commits; or, inside
        any other transaction or while rows wait for the volume, once they are on disk."""
        if self._slots is None:
            return
        if self._pending_frees is not None:
            self._pending_frees.append((slot, quarantine))
        elif self._store.in_tx or self._store.degraded or self._store._levels:  # noqa: SLF001
            self._frees_when_saved.append((slot, quarantine))
        else:
            self._slots.free(slot, quarantine=quarantine)

    def _has_bytes(self, s: SampleRow, file_exists: Callable[[str], bool]) -> bool:
        """Whether a READY/LEASED sample's bytes are still there: its file in the spool, or the
        slot its notice names still its own."""
        n = s.notice
        if n is None or not s.on_disk_bytes:
            return False
        if n.slot is not None:
            return s.slot is not None and s.slot == n.slot
        return bool(n.file) and file_exists(n.file)

    def arena_stats(self) -> ArenaStats | None:
        """The arena's occupancy (None with files), for ``/v1/stats``."""
        with self._lock:
            return self._slots.stats() if self._slots is not None else None

    def _drop_consumed_slot(self, key: P.SampleKey, *, quarantine: bool) -> int:
        """Give back a consumed sample's slot kept for its trainer; returns its bytes."""
        slot, _, _ = self._consumed_slots.pop(key)
        self._store.clear_slot(key)
        self._free_slot(slot, quarantine=quarantine)
        return slot.length

    def attach_slots(self, slots: SlotAllocator) -> None:
        """The arena layout: from now on samples get slots. Call before :meth:`recover`, which
        reserves the slots the ledger's rows still hold."""
        self._slots = slots

    def _tell(self, new: State, old: State | None, n: int, tokens: int) -> None:
        for fn in self.listeners:
            fn(new, old, n, tokens)

    def _tell_deferred(self) -> None:
        """The listeners hear the transitions of a group once it is on disk, never before."""
        events, self._deferred = self._deferred or [], None
        for ev in events:
            self._tell(*ev)

    def _enqueue(self, s: SampleRow, *, front: bool = False) -> None:
        """QUEUED again; the caller saves. At the front for samples that were already under way."""
        if front:
            self._qlo -= 1
            s.qpos = self._qlo
        else:
            self._qhi += 1
            s.qpos = self._qhi
        s.state = State.queued

    def _requeue_front(self, s: SampleRow) -> None:
        """Produce it again, first in the queue, with a new attempt (a late answer or notice of
        the old one is refused) and no error counted: not the sample's fault."""
        s.attempt += 1
        self._reset_prompt(s)
        self._enqueue(s, front=True)
        self._save(s)

    def _add_error(self, s: SampleRow, reason: str) -> None:
        if not s.errors and s.key.job in self.jobs:
            self.jobs[s.key.job].n_errors += 1
        s.errors.append(reason)

    def _reset_prompt(self, s: SampleRow) -> None:
        """Regenerate mode: a sample going back to QUEUED gets a new reply, so its token ids
        return to the prompt alone (else the old reply would become part of the prompt)."""
        if not s.generated:
            return
        if 0 <= s.prompt_len < len(s.token_ids):
            s.token_ids = s.token_ids[: s.prompt_len]
            s.loss_mask = s.loss_mask[: s.prompt_len] if s.loss_mask is not None else None
            self._store.save_tokens(s)
        s.generated = False

    def _make_ready(self, smp: SampleRow, *, front: bool = False) -> None:
        smp.state = State.ready
        dq = self._ready.setdefault(smp.key.job, deque())
        if len(dq) > 2 * self._n_ready + 64:  # drop entries that left READY (lost files, acks without lease)
            dq = self._ready[smp.key.job] = deque(s for s in dq if s.state == State.ready)
        dq.appendleft(smp) if front else dq.append(smp)
        self._save(smp)

    def _unreserve_submitted(self, smp: SampleRow) -> None:
        """A SUBMITTED sample leaves that state: release what it holds (its estimate, or, if
        its file already came in regenerate mode, the file, which the reaper removes)."""
        if smp.notice is not None:
            self.reserved_bytes -= smp.on_disk_bytes
            smp.notice, smp.on_disk_bytes = None, 0
        else:
            self.reserved_bytes -= smp.expected_bytes

    def _retry(self, smp: SampleRow, reason: str) -> None:
        self._add_error(smp, f"attempt {smp.attempt}: {reason}")
        smp.attempt += 1  # the request generation: late answers to older ones are discarded
        if len(smp.errors) >= self.max_attempts:  # failures, not generations, use up attempts
            self._finish(smp, State.failed)
        else:
            self._reset_prompt(smp)
            if self.pricer is not None and (nb := self.pricer(smp)):
                smp.expected_bytes = nb  # out of flight already: what it reserved was released at its old price
            self._enqueue(smp)
            self._save(smp)

    def _finish(self, smp: SampleRow, state: State) -> None:
        smp.state = state
        self._save(smp)
        job = self.jobs[smp.key.job]
        if job.finished is None and job.done:
            job.finished = time.time()
        self._store.save_job(job)

    # ------------------------------------------------------------------ restart
    def recover(self, file_exists: Callable[[str], bool]) -> dict[str, int]:
        """Reload after a restart. SUBMITTED → QUEUED (the request may be lost; a late notice
        for it is discarded as an old attempt); LEASED → READY if its file is still there,
        else QUEUED (the trainer may have used it without acking: it is produced again). A
        LEASED sample in an arena slot is produced again (see ``Leases.release_owner``): its
        trainer had it unchecked in its hands. Only samples that were in flight are read; the
        rest stay in SQLite."""
        stats = Counter()
        with self._lock:
            with self._tx():  # staged rows are a job's whose admission never ended: its client never got the id
                if n := self._db.execute("DELETE FROM staged_samples").rowcount:
                    stats["staged_samples_dropped"] = n
            for jid, created, finished, tok, nb, meta in self._db.execute(
                "SELECT job_id, created, finished, tokens_consumed, bytes_consumed, meta FROM jobs "
                "WHERE summary IS NULL ORDER BY created"
            ).fetchall():
                meta = json.loads(meta or "{}")
                if meta.get(ADMITTING):  # killed while its rows went in: its client never got the id
                    with self._tx():
                        self._db.execute("DELETE FROM samples WHERE job_id=?", (jid,))
                        self._db.execute("DELETE FROM jobs WHERE job_id=?", (jid,))
                    stats["half_admitted_jobs_dropped"] += 1
                    continue
                self.jobs[jid] = Job(jid, 0, created, finished, tok, nb, meta.get("sampling"))
            for jid, st, n in self._db.execute("SELECT job_id, state, count(*) FROM samples GROUP BY job_id, state"):
                if jid in self.jobs:
                    self.jobs[jid].state_counts[st] += n
                    self.jobs[jid].num_samples += n
            errs = "SELECT job_id, count(*) FROM samples WHERE errors IS NOT NULL GROUP BY job_id"
            for jid, n in self._db.execute(errs):
                if jid in self.jobs:
                    self.jobs[jid].n_errors = n
            lo, hi = self._db.execute("SELECT min(qpos), max(qpos) FROM samples WHERE state = 'queued'").fetchone()
            self._qlo, self._qhi = min(lo or 0, self._qlo), max(hi or 0, self._qhi)
            rows = self._db.execute(
                f"SELECT {COLS} FROM samples WHERE state IN ('submitted', 'ready', 'leased') ORDER BY job_id, ord"
            ).fetchall()
            # The listeners (the submitter's SUBMITTED count, the metrics) start from the recovered
            # state and never heard the moves that led to the rows read here: the moves recovery
            # makes are not told to them, or a SUBMITTED → QUEUED would count below zero.
            self._deferred = []
            with self._tx():  # slots consumed samples held for a trainer before the restart: quarantined
                for jid, ep, idx, placement in self._db.execute(
                    "SELECT job_id, epoch, idx, placement FROM samples WHERE placement IS NOT NULL AND state = 'consumed'"
                ).fetchall():
                    held = L.decode_placement(placement)
                    if self._slots is not None and self._slots.reserve(held):
                        self._free_slot(held, quarantine=True)
                    self._db.execute("UPDATE samples SET placement=NULL WHERE job_id=? AND epoch=? AND idx=?", (jid, ep, idx))
                    stats["consumed_slots_quarantined"] += 1
            samples = list(map(row_to_sample, rows))
            for s in samples:  # the slot table from the rows: a slot of another arena (or none now) is gone
                if s.slot is not None and (self._slots is None or not self._slots.reserve(s.slot)):
                    s.slot = None
            with self._tx():
                for s in samples:
                    if s.state == State.submitted:
                        s.attempt += 1  # whatever comes back for the old attempt is discarded
                        s.notice, s.on_disk_bytes = None, 0  # an early (regenerate) file is stray now
                        self._reset_prompt(s)
                        self._enqueue(s, front=True)
                        stats["resubmitted"] += 1
                    elif self._has_bytes(s, file_exists) and not (s.state == State.leased and s.slot is not None):
                        s.state = State.ready
                        self._ready.setdefault(s.key.job, deque()).append(s)
                        self.reserved_bytes += s.on_disk_bytes
                        stats["ready"] += 1
                    else:
                        s.notice, s.on_disk_bytes = None, 0
                        s.attempt += 1
                        self._reset_prompt(s)
                        self._enqueue(s, front=True)
                        stats["regenerate"] += 1
                    self._save(s)
            self._deferred = None
            # a row read as READY and kept READY is no move, so _save counted none of them
            self._n_ready = sum(1 for dq in self._ready.values() for x in dq if x.state == State.ready)
            if self._slots is not None and (n := self._slots.void_stale_claims()):
                stats["stale_claims_voided"] = n
            if self._slots is not None and self._slots.held_at_restart:
                stats["held_ranges_kept"] = self._slots.held_at_restart
        return dict(stats)

