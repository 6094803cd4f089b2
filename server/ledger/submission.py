"""The vLLM side of the state machine: QUEUED → SUBMITTED (within the spool budget) → READY
(its connector's notice, or in regenerate mode also vLLM's reply), or back to QUEUED / FAILED.

Called by the submitter (the event loop) and the notices thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from connector import protocol as P
from server.ledger.core import LedgerCore
from server.ledger.rows import SampleRow
from server.ledger.states import TERMINAL, NoticeOutcome, State
from server.ledger.store import COLS, row_to_sample


class Submission(LedgerCore):
    def next_to_submit(self, budget: int, max_ready: int | None = None, low_water: float = 0.75) -> SampleRow | None:
        """The next queued sample, if its expected bytes fit the spool budget now (and the
        ready-but-unconsumed count is under its limit), with the watermarks of
        :class:`~server.ledger.budget.SpoolBudget`."""
        with self._lock:
            if self._store.degraded:  # rows wait for the volume: no new work until they are written
                return None
            if self._spool.closed(self._n_ready, budget, max_ready, low_water, self.pinned_bytes):
                return None
            head = f"SELECT {COLS} FROM samples WHERE state = 'queued' ORDER BY qpos LIMIT 1"  # the queue index
            while True:
                row = self._db.execute(head).fetchone()
                if row is None:
                    return None
                s = row_to_sample(row)
                if not ((job := self.jobs.get(s.key.job)) is not None and job.cancelling):
                    break
                s.state = State.cancelled  # its job's cancel has not reached this row yet
                self._save(s)
            if not self._spool.fits(s.expected_bytes, budget):
                return None
            if self._slots is not None and s.expected_bytes > 0 and job is not None and job.sampling is None \
                    and self._slots.fits_ever(s.expected_bytes):
                # The arena: a slot of the priced size (regenerate mode and an unknown shape have
                # no size before vLLM answers, and a sample larger than the arena: a file).
                slot = self._slots.alloc(s.expected_bytes)
                if slot is None:  # no free range that large yet: wait as for a full budget
                    self._spool.throttled = True
                    return None
                s.slot = slot
            s.state = State.submitted
            s.submitted_at = time.monotonic()
            self.reserved_bytes += s.expected_bytes
            self._save(s)
            return s

    def _queued_chunks(self, chunk: int = 2000) -> Iterable[list[SampleRow]]:
        """QUEUED samples (they live in SQLite only) a chunk at a time. Yields with the lock
        held, so the caller may change and save them before any other thread sees them."""
        last = 0
        while True:
            with self._lock:
                rows = self._db.execute(f"SELECT rowid, {COLS} FROM samples WHERE state = 'queued' AND rowid > ? "
                                        "ORDER BY rowid LIMIT ?", (last, chunk)).fetchall()  # fmt: skip
                if not rows:
                    return
                last = rows[-1][0]
                with self._tx():
                    yield [row_to_sample(r[1:]) for r in rows]

    def reprice_queued(self, size_of: Callable[[SampleRow], int]) -> int:
        """New expected bytes for every QUEUED sample (the sample size became known, or a
        notice corrected it). Samples in flight keep what they reserved. Returns how many changed."""
        changed = 0
        for samples in self._queued_chunks():
            for s in samples:
                if s.key.job in self.jobs and (nb := size_of(s)) != s.expected_bytes:
                    self._db.execute("UPDATE samples SET expected_bytes=? WHERE job_id=? AND epoch=? AND idx=?",
                                     (nb, s.key.job, s.key.epoch, s.key.index))  # fmt: skip
                    changed += 1
        return changed

    def fail_queued(self, reason_of: Callable[[SampleRow], str | None]) -> int:
        """Fail every QUEUED sample for which ``reason_of`` gives a reason, spending no
        attempt (a limit learned after admission: retrying cannot help)."""
        failed = 0
        for samples in self._queued_chunks():
            for s in samples:
                if s.key.job in self.jobs and (r := reason_of(s)):
                    self._add_error(s, r)
                    self._finish(s, State.failed)
                    failed += 1
        return failed

    def requeue(self, key: P.SampleKey, attempt: int, reason: str, *, count_attempt: bool = True) -> None:
        """vLLM refused, errored or timed out: retry with a new attempt, or fail for good.

        ``count_attempt=False`` is for vLLM being unreachable: not the sample's fault, so it
        waits without using up its attempts (the submitter bounds the wait by a deadline)."""
        with self._lock:
            smp = self._live.get(key)
            if smp is None or smp.state != State.submitted or smp.attempt != attempt:
                return
            self._unreserve_submitted(smp)
            if count_attempt:
                self._retry(smp, reason)
            else:
                self._requeue_front(smp)

    def fail(self, key: P.SampleKey, reason: str) -> None:
        with self._lock:
            s = self.get(key)
            if s is None or s.state in TERMINAL:
                return
            if s.state == State.submitted:
                self._unreserve_submitted(s)
            self._add_error(s, reason)
            self._finish(s, State.failed)

    def responded(self, key: P.SampleKey, attempt: int) -> None:
        """vLLM answered the request: the notice is due from now on. The notice timeout counts
        from here, not from submission, so a request slower than the timeout does not race
        its own notice."""
        with self._lock:
            smp = self.get(key)
            if smp is not None and smp.state == State.submitted and smp.attempt == attempt:
                smp.submitted_at = time.monotonic()

    def stale_submissions(self, older_than_s: float) -> list[SampleRow]:
        """SUBMITTED samples with no notice for too long (lost request, dead connector); the
        time counts from vLLM's response (``responded``) once there is one."""
        now = time.monotonic()
        with self._lock:
            return [s for s in self._live.values()
                    if s.state == State.submitted and now - s.submitted_at > older_than_s]  # fmt: skip

    def awaits_notice(self, key: P.SampleKey, attempt: int) -> bool:
        """True while ``key`` is SUBMITTED at ``attempt`` with no notice yet: a file of that
        attempt in the spool is this sample's, its notice still on the way."""
        with self._lock:
            s = self._live.get(key)
            return s is not None and s.state == State.submitted and s.attempt == attempt and s.notice is None

    def on_notice(self, n: P.Notice, file_bytes: int) -> NoticeOutcome:
        """Apply a connector notice; the outcome says what becomes of its file."""
        with self._lock:
            smp = self._live.get(n.key) if n.key else None
            if smp is None or smp.attempt != n.attempt or smp.state != State.submitted:
                return NoticeOutcome.refused  # unknown, cancelled, or a late notice for an older attempt
            if smp.notice is not None:  # a repeat: changes nothing
                same = smp.notice.file == n.file and smp.notice.slot == n.slot
                return NoticeOutcome.held if same else NoticeOutcome.refused
            if n.slot is not None and n.slot != smp.slot:
                return NoticeOutcome.refused  # not the slot this attempt was given (forged, or a stale copy)
            self.reserved_bytes -= smp.expected_bytes
            # A slot refused because the sidecar priced it too small (the shape this notice taught says
            # so) is not the sample's fault: it goes again at the right price without using an attempt,
            # as a busy connector's does. Once at most: the next slot is priced by that same shape.
            price = self.pricer(smp) if n.status == P.NoticeStatus.error and smp.slot is not None and self.pricer else None
            mispriced = price is not None and price > smp.slot.length  # type: ignore[union-attr]
            if smp.slot is not None and (n.slot is None or n.status != P.NoticeStatus.ok) and self._slots is not None:
                # Its writer did not use the slot (wrote a file, was busy or failed) — or says so: notices
                # are not proof (a forged one needs only the key and attempt), so quarantined.
                self._free_slot(smp.slot, quarantine=True)
                smp.slot = None
            if n.status == P.NoticeStatus.busy or mispriced:  # not the sample's fault: no attempt used
                smp.attempt += 1
                self._reset_prompt(smp)
                if mispriced:
                    smp.expected_bytes = price  # type: ignore[assignment]
                    self.repriced_refusals += 1
                self._enqueue(smp)
                self._save(smp)
                return NoticeOutcome.refused
            if n.status != P.NoticeStatus.ok:
                self._retry(smp, n.reason or "connector error")
                return NoticeOutcome.refused
            smp.notice = n
            smp.on_disk_bytes = file_bytes
            self.reserved_bytes += file_bytes
            if self.jobs[smp.key.job].sampling is not None and not smp.generated:
                self._save(smp)  # regenerate mode: READY once vLLM's reply (the token ids) is known
                return NoticeOutcome.held
            self._make_ready(smp)
            return NoticeOutcome.ready

    def set_generated(self, key: P.SampleKey, attempt: int, output_ids: list[int]) -> bool:
        """Regenerate mode: vLLM's reply is in. The file holds prompt + reply − 1 positions
        (the last generated token was never fed back); the loss mask covers the reply.
        True if this made the sample READY (its notice had come first)."""
        with self._lock:
            smp = self._live.get(key)
            if smp is None or smp.state != State.submitted or smp.attempt != attempt or smp.generated:
                return False
            keep = output_ids[:-1]
            smp.token_ids = smp.token_ids + keep
            smp.loss_mask = (smp.loss_mask or [0] * (len(smp.token_ids) - len(keep))) + [1] * len(keep)
            smp.generated = True
            self._store.save_tokens(smp)
            if smp.notice is not None:
                self._make_ready(smp)
                return True
            return False
