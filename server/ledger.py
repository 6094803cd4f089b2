"""Every sample's state: the single source of truth for "nothing lost, nothing counted twice".

QUEUED → SUBMITTED → READY → LEASED → CONSUMED, or FAILED / CANCELLED. The submitter, the
notice thread and the delivery thread all move samples through here under one lock, so each
transition is checked against the current state and attempt (a late notice for an old
attempt cannot resurrect a sample; a second ack cannot count twice).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum

from connector import protocol as P


class State(str, Enum):
    queued = "queued"
    submitted = "submitted"
    ready = "ready"
    leased = "leased"
    consumed = "consumed"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = {State.consumed, State.failed, State.cancelled}


@dataclass
class Sample:
    key: P.SampleKey
    token_ids: list[int]
    loss_mask: list[int] | None
    label: str | None
    expected_bytes: int
    state: State = State.queued
    attempt: int = 0
    notice: P.Notice | None = None
    on_disk_bytes: int = 0  # file present in the spool (READY/LEASED until received)
    lease_owner: bytes | None = None
    lease_deadline: float = 0.0
    errors: list[str] = field(default_factory=list)


@dataclass
class Job:
    job_id: str
    samples: list[Sample]
    created: float = field(default_factory=time.time)
    finished: float | None = None
    tokens_consumed: int = 0

    def counts(self) -> dict[str, int]:
        c = Counter(s.state.value for s in self.samples)
        return {st.value: c.get(st.value, 0) for st in State}

    @property
    def done(self) -> bool:
        return all(s.state in TERMINAL for s in self.samples)


class TransitionError(RuntimeError):
    pass


class Ledger:
    def __init__(self, max_attempts: int = 3) -> None:
        self.max_attempts = max_attempts
        self.jobs: dict[str, Job] = {}
        self._lock = threading.RLock()
        self._queue: deque[Sample] = deque()
        self._ready: deque[Sample] = deque()
        self.reserved_bytes = 0  # expected bytes of SUBMITTED + real bytes of files on disk

    # ------------------------------------------------------------------ jobs
    def add_job(self, samples: list[tuple[list[int], list[int] | None, str | None, int]]) -> Job:
        job_id = uuid.uuid4().hex[:16]
        with self._lock:
            job = Job(job_id, [])
            for i, (ids, mask, label, nbytes) in enumerate(samples):
                s = Sample(P.SampleKey(job=job_id, index=i), ids, mask, label, nbytes)
                job.samples.append(s)
                self._queue.append(s)
            self.jobs[job_id] = job
            return job

    def get(self, key: P.SampleKey) -> Sample | None:
        job = self.jobs.get(key.job)
        if job is None or key.index >= len(job.samples):
            return None
        s = job.samples[key.index]
        return s if s.key == key else None

    # ------------------------------------------------------------------ submission
    def next_to_submit(self, budget: int) -> Sample | None:
        """The next queued sample, if its expected bytes fit the spool budget now."""
        with self._lock:
            while self._queue:
                s = self._queue[0]
                if s.state != State.queued:
                    self._queue.popleft()
                    continue
                if self.reserved_bytes + s.expected_bytes > budget and self.reserved_bytes > 0:
                    return None
                self._queue.popleft()
                s.state = State.submitted
                self.reserved_bytes += s.expected_bytes
                return s
            return None

    def submit_failed(self, s: P.SampleKey, attempt: int, reason: str) -> None:
        """vLLM refused or errored: retry with a new attempt, or fail for good."""
        with self._lock:
            smp = self.get(s)
            if smp is None or smp.state != State.submitted or smp.attempt != attempt:
                return
            self.reserved_bytes -= smp.expected_bytes
            self._retry(smp, reason)

    def _retry(self, smp: Sample, reason: str) -> None:
        smp.errors.append(f"attempt {smp.attempt}: {reason}")
        smp.attempt += 1
        if smp.attempt >= self.max_attempts:
            self._finish(smp, State.failed)
        else:
            smp.state = State.queued
            self._queue.append(smp)

    def _finish(self, smp: Sample, state: State) -> None:
        smp.state = state
        job = self.jobs[smp.key.job]
        if job.done and job.finished is None:
            job.finished = time.time()

    # ------------------------------------------------------------------ notices
    def on_notice(self, n: P.Notice, file_bytes: int) -> str:
        """Apply a connector notice; returns what to do with its file: 'keep' or 'delete'."""
        with self._lock:
            smp = self.get(n.key) if n.key else None
            if smp is None or smp.attempt != n.attempt or smp.state != State.submitted:
                return "delete"  # unknown, cancelled, or a late notice for an older attempt
            self.reserved_bytes -= smp.expected_bytes
            if n.status != P.NoticeStatus.ok:
                self._retry(smp, n.reason or "connector error")
                return "delete"
            smp.notice = n
            smp.state = State.ready
            smp.on_disk_bytes = file_bytes
            self.reserved_bytes += file_bytes
            self._ready.append(smp)
            return "keep"

    # ------------------------------------------------------------------ delivery
    def lease_next(self, owner: bytes, jobs: list[str] | None, lease_s: float) -> Sample | None:
        with self._lock:
            for _ in range(len(self._ready)):
                s = self._ready.popleft()
                if s.state != State.ready:
                    continue
                if jobs is not None and s.key.job not in jobs:
                    self._ready.append(s)
                    continue
                s.state = State.leased
                s.lease_owner = owner
                s.lease_deadline = time.monotonic() + lease_s
                return s
            return None

    def received(self, owner: bytes, key: P.SampleKey) -> int:
        """The trainer holds the bytes and the file is gone: its spool bytes are free again."""
        with self._lock:
            s = self.get(key)
            if s is None or s.lease_owner != owner or s.on_disk_bytes == 0:
                return 0
            freed, s.on_disk_bytes = s.on_disk_bytes, 0
            self.reserved_bytes -= freed
            return freed

    def ack(self, owner: bytes, key: P.SampleKey) -> bool:
        """First ack wins; a repeated or foreign ack changes nothing."""
        with self._lock:
            s = self.get(key)
            if s is None or s.state != State.leased or s.lease_owner != owner:
                return False
            self.received(owner, key)
            s.lease_owner = None
            self.jobs[key.job].tokens_consumed += len(s.token_ids)
            self._finish(s, State.consumed)
            return True

    def trainer_failed(self, owner: bytes, key: P.SampleKey, reason: str) -> str | None:
        """The trainer found the sample invalid: regenerate it. Returns a file to delete."""
        with self._lock:
            s = self.get(key)
            if s is None or s.state != State.leased or s.lease_owner != owner:
                return None
            self.received(owner, key)
            s.lease_owner = None
            f = s.notice.file if s.notice else None
            s.notice = None
            self._retry(s, f"trainer: {reason}")
            return f

    def release_owner(self, owner: bytes, file_exists) -> None:  # noqa: ANN001
        """A trainer went away: its leases go back to READY if the file is there, else QUEUED."""
        with self._lock:
            for job in self.jobs.values():
                for s in job.samples:
                    if s.state == State.leased and s.lease_owner == owner:
                        s.lease_owner = None
                        if s.on_disk_bytes and s.notice and file_exists(s.notice.file):
                            s.state = State.ready
                            self._ready.appendleft(s)
                        else:
                            self.reserved_bytes -= s.on_disk_bytes
                            s.on_disk_bytes = 0
                            s.notice = None
                            s.state = State.queued
                            self._queue.append(s)

    def jobs_done(self, jobs: list[str] | None) -> bool:
        with self._lock:
            sel = [self.jobs[j] for j in jobs if j in self.jobs] if jobs else list(self.jobs.values())
            if jobs and len(sel) != len(jobs):
                return False
            return bool(sel) and all(j.done for j in sel)
