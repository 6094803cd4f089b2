"""The trainer side of the state machine: READY → LEASED → CONSUMED, or back to READY / QUEUED
when a trainer goes away, refuses a sample or a file is lost.

Called by the delivery thread. A trainer settles a sample (RECEIVED, ACK, FAIL) only with the
secret token of the sample's latest lease (:meth:`Leases.holds`).
"""

from __future__ import annotations

import hmac
import secrets
from collections import Counter, deque
from collections.abc import Callable

from connector import protocol as P
from server.ledger.core import LedgerCore
from server.ledger.rows import SampleRow
from server.ledger.states import IN_FLIGHT, TERMINAL, State


class Leases(LedgerCore):
    def _lease(self, s: SampleRow, owner: bytes) -> None:
        s.state = State.leased
        s.lease_owner, s.lease_token = owner, secrets.token_hex(16)
        self._save(s)

    def lease_next(self, owner: bytes, jobs: list[str] | None) -> SampleRow | None:
        """The oldest READY sample of the first of ``jobs`` (any job if None) that has one."""
        with self._lock:
            for job in list(self._ready) if jobs is None else jobs:
                dq = self._ready.get(job)
                while dq:
                    s = dq.popleft()
                    if s.state != State.ready:
                        continue
                    self._lease(s, owner)
                    return s
                self._ready.pop(job, None)
            return None

    def lease_many(self, owner: bytes, jobs: list[str] | None, n: int) -> list[SampleRow]:
        """Up to ``n`` samples as :meth:`lease_next` gives them, in one transaction: the caller
        sends them once this returns, so every lease a trainer hears of is on disk. If the write
        fails, none is leased: they are READY again, at the front, and the error propagates."""
        out: list[SampleRow] = []
        tokens: list[str | None] = []  # each one's previous token, put back if the leases are undone
        if n <= 0:
            return out
        with self._lock:
            self._deferred = []
            try:
                with self._tx():
                    for job in list(self._ready) if jobs is None else jobs:
                        dq = self._ready.get(job)
                        while dq and len(out) < n:
                            s = dq.popleft()
                            if s.state != State.ready:
                                continue
                            out.append(s)
                            tokens.append(s.lease_token)
                            self._lease(s, owner)
                        if not dq:
                            self._ready.pop(job, None)
                        if len(out) >= n:
                            break
            except BaseException:
                for s, token in zip(reversed(out), reversed(tokens), strict=True):
                    s.lease_token = token
                    if s.saved == State.leased:  # its write went through before the failure: undo the counts
                        s.saved = State.ready
                        self._n_ready += 1
                        if (job := self.jobs.get(s.key.job)) is not None:
                            job.state_counts[State.leased.value] -= 1
                            job.state_counts[State.ready.value] += 1
                    s.state, s.lease_owner = State.ready, None
                    self._ready.setdefault(s.key.job, deque()).appendleft(s)
                self._deferred = None
                raise
            self._tell_deferred()
            return out

    def holds(self, key: P.SampleKey, token: str | None) -> bool:
        """Whether ``token`` is the secret of ``key``'s latest lease: the proof that whoever
        sends it was delivered the sample. Nothing else lets a trainer settle one."""
        with self._lock:
            if (held := self._consumed_slots.get(key)) is not None:  # its job may be compacted already
                return bool(token) and hmac.compare_digest(held[2], token)  # type: ignore[arg-type]
            s = self.get(key)
            return bool(s is not None and s.lease_token and token and hmac.compare_digest(s.lease_token, token))

    def received(self, owner: bytes, key: P.SampleKey, token: str | None,
                 file_exists: Callable[[str], bool] | None = None) -> int:  # fmt: skip
        """The trainer holds the bytes and the file is gone: its spool bytes are free again.
        Only with the lease's ``token`` (:meth:`holds`); without it nothing changes.

        From a trainer that no longer holds the lease (it lapsed, or we restarted), the file
        it was sent is gone all the same: if that is the sample's file, the sample is produced
        again rather than offered to another trainer with no file behind it (its ack, if it
        comes, still counts once). But a RECEIVED names a key, not a file: one that waited in
        the trainer's socket while we restarted arrives after the sample was produced again,
        and is about the old file. So a sample whose file is still there (``file_exists``)
        stays READY: taking it for lost would drop the new file from the ledger and leave it
        in the spool for the reaper. ``file_exists`` None: cannot tell, taken as gone."""
        with self._lock:
            if (held := self._consumed_slots.get(key)) is not None:
                # Acked before this RECEIVED (its views outlived the ack): the slot is free now.
                if held[1] != owner or not self.holds(key, token):
                    return 0
                return self._drop_consumed_slot(key, quarantine=False)
            s = self._live.get(key)
            if s is None or s.on_disk_bytes == 0 or not self.holds(key, token):
                return 0
            if s.lease_owner != owner:
                if s.lease_owner is None and s.state == State.ready and not (s.notice and s.notice.slot):
                    # (a slot is not deleted by its reader: the old copy's RECEIVED says nothing of it)
                    name = s.notice.file if s.notice is not None else None
                    if file_exists is None or name is None or not file_exists(name):
                        self.file_lost(key)
                return 0
            freed, s.on_disk_bytes = s.on_disk_bytes, 0
            self.reserved_bytes -= freed
            self._save(s)
            return freed

    def ack(self, owner: bytes, key: P.SampleKey, token: str | None,
            orphans: list[tuple[P.SampleKey, str]] | None = None) -> bool:  # fmt: skip
        """First ack wins; a repeated ack, one for a sample another trainer holds, or one
        without the token of the sample's latest lease (:meth:`holds`) changes nothing. An ack
        for a sample no one holds now, with that token (the trainer used it before its lease
        lapsed or the sidecar restarted), is accepted: it was consumed, once.

        A file the sample still has in the spool (READY again, produced a second time after a
        restart while the trainer used the first copy; or leased and never RECEIVED) has no
        reader any more: it goes into ``orphans`` (key, file) for the caller to delete once
        the ack is on disk. Kept, it would outlive its sample until the reaper's grace."""
        with self._lock:
            s = self.get(key)
            if s is None or s.state in TERMINAL or not self.holds(key, token):
                return False
            if s.lease_owner is not None and s.lease_owner != owner:
                return False
            if s.state == State.submitted and s.notice is None:
                self.reserved_bytes -= s.expected_bytes
            if orphans is not None and s.on_disk_bytes and s.notice is not None and s.notice.file:
                orphans.append((key, s.notice.file))
            if s.slot is not None and s.on_disk_bytes and s.lease_owner == owner and self._slots is not None:
                # Acked while its trainer may still hold views (no RECEIVED yet): the slot stays its.
                self._consumed_slots[key] = (s.slot, owner, token)  # type: ignore[assignment]
            elif s.slot is not None and s.on_disk_bytes and s.lease_owner is None:
                # Acked by a trainer whose lease lapsed (or from before a restart): it may still
                # hold views of the slot, and no RECEIVED of it will come now.
                self._free_slot(s.slot, quarantine=True)
                s.slot = None
            self.reserved_bytes -= s.on_disk_bytes
            s.on_disk_bytes = 0
            s.lease_owner = None
            job = self.jobs[key.job]
            job.tokens_consumed += len(s.token_ids)
            job.bytes_consumed += s.notice.nbytes if s.notice else 0
            self._finish(s, State.consumed)
            return True

    def ack_many(
        self, owner: bytes, keys: list[P.SampleKey], tokens: list[str],
        orphans: list[tuple[P.SampleKey, str]] | None = None,
    ) -> tuple[int, int]:  # fmt: skip
        """Apply one ACK message as a whole: all its keys, in one transaction, or none (an error
        part-way rolls back the database and the in-memory state alike, then propagates).
        ``tokens[i]`` is ``keys[i]``'s lease token (see :meth:`ack`).
        Returns (acked, ignored as repeats or not this trainer's); the files the acks left
        without a reader are added to ``orphans`` (see :meth:`ack`), only if it applied."""
        with self._lock:
            samples = [s for k in keys if (s := self.get(k)) is not None]
            jobs = {s.key.job: self.jobs[s.key.job] for s in samples}
            saved = ([(s, s.state, s.saved, s.on_disk_bytes, s.lease_owner, s.slot) for s in samples],
                     [(j, j.tokens_consumed, j.bytes_consumed, Counter(j.state_counts), j.finished)
                      for j in jobs.values()],
                     self.reserved_bytes, self._n_ready, dict(self._consumed_slots))  # fmt: skip
            self._deferred, self._pending_frees = [], []
            try:
                left: list[tuple[P.SampleKey, str]] = []
                with self._tx():
                    acked = sum(self.ack(owner, k, t, left) for k, t in zip(keys, tokens, strict=True))
            except BaseException:
                self._pending_frees = None  # rolled back: the slots stay their samples'
                for smp, state, was_saved, on_disk, lease, slot in saved[0]:
                    smp.state, smp.saved, smp.on_disk_bytes, smp.lease_owner = state, was_saved, on_disk, lease
                    smp.slot = slot
                    if state in IN_FLIGHT:
                        self._live[smp.key] = smp
                for j, tok, nb, counts, fin in saved[1]:
                    j.tokens_consumed, j.bytes_consumed, j.state_counts, j.finished = tok, nb, counts, fin
                self.reserved_bytes, self._n_ready = saved[2], saved[3]
                self._consumed_slots.clear()  # as they were: kept for acks that did not apply go
                self._consumed_slots.update(saved[4])
                self._deferred = None
                raise
            # Applied: the frees the transaction held back, then the listeners, whatever happens.
            frees, self._pending_frees = self._pending_frees, None
            try:
                for slot, quarantine in frees:
                    self._free_slot(slot, quarantine=quarantine)
            finally:
                self._tell_deferred()
            if orphans is not None:
                orphans.extend(left)
            return acked, len(keys) - acked

    def trainer_failed(self, owner: bytes, key: P.SampleKey, token: str | None, reason: str, *,
                       not_received: bool = False) -> str | None:  # fmt: skip
        """The trainer found the sample invalid: regenerate it. Returns a file to delete. Only
        from the trainer holding its lease, with the lease's ``token``.

        ``not_received``: the trainer never had the bytes (the file was gone or unreadable in
        the spool): produced again as a lost file is, with a new attempt number (a late notice
        of this one is refused) and no error counted, since the sample itself was never seen."""
        with self._lock:
            s = self._live.get(key)
            if s is None or s.state != State.leased or s.lease_owner != owner or not self.holds(key, token):
                return None
            if s.slot is not None:
                # A refused slot may have had a late writer in it (another attempt's bytes, a
                # torn write): it waits out the quarantine, as a slot left by a dead writer does.
                self._free_slot(s.slot, quarantine=True)
                s.slot = None
            self.received(owner, key, token)
            s.lease_owner = None
            f = s.notice.file if s.notice else None
            s.notice = None
            if not_received:
                self._requeue_front(s)
            else:
                self._retry(s, f"trainer: {reason}")
            return f

    def release_owner(self, owner: bytes, file_exists: Callable[[str], bool]) -> int:
        """A trainer went away: its leases go back to READY if the file is there, else QUEUED.

        A sample in an arena slot is produced again (QUEUED, a new attempt, no error counted)
        rather than offered to the next trainer: the trainer that held it may have had it
        unchecked in its hands (a slot's bytes are trusted without a checksum), and a file's
        bytes are checked by every reader, a slot's are not. Its slot is given back quarantined;
        while the gone trainer, if it lives, still views it, the slot's hold keeps it out of the
        free list (``server/arena.py``)."""
        n = 0
        with self._lock:
            for key in [k for k, (_, o, _) in self._consumed_slots.items() if o == owner]:
                self._drop_consumed_slot(key, quarantine=True)  # its views, if any, may still be read
            for s in [x for x in self._live.values() if x.state == State.leased and x.lease_owner == owner]:
                n += 1
                s.lease_owner = None
                if self._has_bytes(s, file_exists) and not s.notice.slot:  # type: ignore[union-attr]
                    self._make_ready(s, front=True)
                    continue
                self.reserved_bytes -= s.on_disk_bytes
                s.on_disk_bytes = 0
                s.notice = None
                self._requeue_front(s)
        return n

    def unlease(self, owner: bytes, keys: list[P.SampleKey], file_exists: Callable[[str], bool]) -> int:
        """Leases whose DELIVER never left (the trainer's queue was full): READY again at the
        front, in their order, in one transaction; a sample whose file is gone is produced again."""
        n = 0
        with self._lock, self._tx():
            for key in reversed(keys):
                s = self._live.get(key)
                if s is None or s.state != State.leased or s.lease_owner != owner:
                    continue
                n += 1
                s.lease_owner = None
                if self._has_bytes(s, file_exists):
                    self._make_ready(s, front=True)
                else:
                    self.file_lost(key)
        return n

    def file_lost(self, key: P.SampleKey) -> None:
        """A READY/LEASED sample's file vanished: produce it again (not the sample's fault)."""
        with self._lock:
            s = self._live.get(key)
            if s is None or s.state not in (State.ready, State.leased):
                return
            self.reserved_bytes -= s.on_disk_bytes
            s.on_disk_bytes, s.notice, s.lease_owner = 0, None, None
            self._requeue_front(s)
