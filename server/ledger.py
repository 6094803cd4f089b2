"""Every sample's state: the single source of truth for "nothing lost, nothing counted twice".

QUEUED → SUBMITTED → READY → LEASED → CONSUMED, or FAILED / CANCELLED. The submitter, the
notice thread and the delivery thread all move samples through here under one lock, so each
transition is checked against the current state and attempt (a late notice for an old
attempt cannot resurrect a sample; a second ack cannot count twice).

Every transition is written through to SQLite (WAL) before the lock is released, so a
sidecar killed at any moment restarts from a state it had really reached. On restart,
SUBMITTED and LEASED samples cannot be trusted (the request or the trainer may be gone) and
are recovered: see :meth:`Ledger.recover`.
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
import uuid
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

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
    submitted_at: float = 0.0
    errors: list[str] = field(default_factory=list)
    generated: bool = False  # regenerate mode: vLLM's reply is known (token ids final)
    prompt_len: int = -1  # regenerate mode: token_ids beyond this are vLLM's reply


@dataclass
class Job:
    job_id: str
    samples: list[Sample]
    created: float = field(default_factory=time.time)
    finished: float | None = None
    tokens_consumed: int = 0
    bytes_consumed: int = 0
    sampling: dict | None = None  # regenerate mode: vLLM writes the reply with these
    by_key: dict[tuple[int, int], Sample] = field(default_factory=dict, repr=False)

    def counts(self) -> dict[str, int]:
        c = Counter(s.state.value for s in self.samples)
        return {st.value: c.get(st.value, 0) for st in State}

    n_terminal: int = 0  # kept by the ledger: checked every few ms by delivery, must be O(1)

    @property
    def done(self) -> bool:
        return self.n_terminal == len(self.samples)


@dataclass
class NewSample:
    token_ids: list[int]
    loss_mask: list[int] | None
    label: str | None
    expected_bytes: int


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, created REAL, finished REAL, tokens_consumed INTEGER DEFAULT 0,
  bytes_consumed INTEGER DEFAULT 0, meta TEXT);
CREATE TABLE IF NOT EXISTS samples (
  job_id TEXT, epoch INTEGER, idx INTEGER, ord INTEGER, token_ids BLOB, loss_mask BLOB, label TEXT,
  expected_bytes INTEGER, state TEXT, attempt INTEGER, notice TEXT, on_disk_bytes INTEGER, errors TEXT,
  prompt_len INTEGER, PRIMARY KEY (job_id, epoch, idx));
"""


def _pack(ids: list[int] | None) -> bytes | None:
    return None if ids is None else array("i", ids).tobytes()


def _unpack(b: bytes | None) -> list[int] | None:
    if b is None:
        return None
    a = array("i")
    a.frombytes(b)
    return a.tolist()


class Ledger:
    def __init__(self, path: str | Path | None = None, max_attempts: int = 3) -> None:
        self.max_attempts = max_attempts
        self.jobs: dict[str, Job] = {}
        self._lock = threading.RLock()
        self._queue: deque[Sample] = deque()
        self._ready: deque[Sample] = deque()
        self.reserved_bytes = 0  # expected bytes of SUBMITTED + real bytes of files on disk
        self._throttled = False  # a limit was hit: wait for the low watermark
        self.path = str(path) if path else ":memory:"
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.listeners: list[Callable[[Sample, State], None]] = []

    def is_open(self) -> bool:
        try:
            self._db.execute("SELECT 1")
            return True
        except sqlite3.Error:
            return False

    # ------------------------------------------------------------------ persistence
    def _save(self, s: Sample, old: State | None = None) -> None:
        self._db.execute(
            "UPDATE samples SET state=?, attempt=?, notice=?, on_disk_bytes=?, errors=? "
            "WHERE job_id=? AND epoch=? AND idx=?",
            (s.state.value, s.attempt, s.notice.model_dump_json() if s.notice else None, s.on_disk_bytes,
             json.dumps(s.errors), s.key.job, s.key.epoch, s.key.index),
        )  # fmt: skip
        if old is not None and old != s.state:
            for fn in self.listeners:
                fn(s, old)

    @contextmanager
    def _tx(self):  # noqa: ANN202
        """One transaction; rolled back on error so the connection never stays inside one."""
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _reset_prompt(self, s: Sample) -> None:
        """Regenerate mode: a sample going back to QUEUED gets a new reply, so its token ids
        return to the prompt alone (else the old reply would become part of the prompt)."""
        if not s.generated:
            return
        if 0 <= s.prompt_len < len(s.token_ids):
            s.token_ids = s.token_ids[: s.prompt_len]
            s.loss_mask = s.loss_mask[: s.prompt_len] if s.loss_mask is not None else None
            self._db.execute("UPDATE samples SET token_ids=?, loss_mask=? WHERE job_id=? AND epoch=? AND idx=?",
                             (_pack(s.token_ids), _pack(s.loss_mask), s.key.job, s.key.epoch, s.key.index))  # fmt: skip
        s.generated = False

    def _save_job(self, j: Job) -> None:
        self._db.execute(
            "UPDATE jobs SET finished=?, tokens_consumed=?, bytes_consumed=? WHERE job_id=?",
            (j.finished, j.tokens_consumed, j.bytes_consumed, j.job_id),
        )

    def recover(self, file_exists: Callable[[str], bool]) -> dict[str, int]:
        """Reload after a restart. SUBMITTED → QUEUED (the request may be lost; a late notice
        for it is discarded as an old attempt); LEASED → READY if its file is still there,
        else QUEUED (the trainer may have used it without acking: it is produced again)."""
        stats = Counter()
        with self._lock:
            for jid, created, finished, tok, nb, meta in self._db.execute(
                "SELECT job_id, created, finished, tokens_consumed, bytes_consumed, meta FROM jobs ORDER BY created"
            ):
                self.jobs[jid] = Job(jid, [], created, finished, tok, nb, json.loads(meta or "{}").get("sampling"))
            rows = self._db.execute(
                "SELECT job_id, epoch, idx, token_ids, loss_mask, label, expected_bytes, state, attempt, notice, "
                "on_disk_bytes, errors, prompt_len FROM samples ORDER BY job_id, ord"
            ).fetchall()
            with self._tx():
                for jid, ep, idx, ids, mask, label, eb, st, att, notice, odb, errs, plen in rows:
                    s = Sample(P.SampleKey(job=jid, epoch=ep, index=idx), _unpack(ids) or [], _unpack(mask), label, eb,
                               State(st), att, P.Notice.model_validate_json(notice) if notice else None, odb,
                               errors=json.loads(errs or "[]"), prompt_len=plen if plen is not None else -1)  # fmt: skip
                    s.generated = s.prompt_len >= 0 and len(s.token_ids) > s.prompt_len
                    job = self.jobs[jid]
                    job.samples.append(s)
                    job.n_terminal += s.state in TERMINAL
                    job.by_key[(ep, idx)] = s
                    if s.state == State.submitted:
                        s.attempt += 1  # whatever comes back for the old attempt is discarded
                        s.state = State.queued
                        s.notice, s.on_disk_bytes = None, 0  # an early (regenerate) file is stray now
                        self._reset_prompt(s)
                        stats["resubmitted"] += 1
                    if s.state in (State.ready, State.leased):
                        if s.notice and s.notice.file and file_exists(s.notice.file):
                            s.state = State.ready
                            self._ready.append(s)
                            self.reserved_bytes += s.on_disk_bytes
                            stats["ready"] += 1
                        else:
                            s.state, s.notice, s.on_disk_bytes = State.queued, None, 0
                            s.attempt += 1
                            self._reset_prompt(s)
                            stats["regenerate"] += 1
                    if s.state == State.queued:
                        self._queue.append(s)
                    self._save(s)
        return dict(stats)

    def live_files(self) -> set[str]:
        """Files the ledger still expects in the spool; anything else there is garbage."""
        with self._lock:
            return {
                s.notice.file for j in self.jobs.values() for s in j.samples
                if s.state in (State.ready, State.leased, State.submitted) and s.notice and s.notice.file
            }  # fmt: skip

    # ------------------------------------------------------------------ jobs
    def add_job(
        self, samples: list[NewSample], *, epochs: int = 1, seed: int = 0, meta: dict | None = None,
        sampling: dict | None = None,
    ) -> Job:
        """Queue a job. Each epoch submits the data again in a seeded shuffle (hidden states are
        regenerated, never stored), so epoch e of sample i has its own key (job, i, e)."""
        job_id = uuid.uuid4().hex[:16]
        with self._lock:
            job = Job(job_id, [], sampling=sampling)
            with self._tx():
                self._db.execute("INSERT INTO jobs (job_id, created, meta) VALUES (?, ?, ?)",
                                 (job_id, job.created, json.dumps({**(meta or {}), "sampling": sampling})))  # fmt: skip
                order = 0
                rows = []
                for ep in range(epochs):
                    idxs = list(range(len(samples)))
                    if epochs > 1 or seed:
                        random.Random(seed * 1_000_003 + ep).shuffle(idxs)
                    for i in idxs:
                        n = samples[i]
                        s = Sample(P.SampleKey(job=job_id, index=i, epoch=ep), n.token_ids, n.loss_mask, n.label,
                                   n.expected_bytes, prompt_len=len(n.token_ids))  # fmt: skip
                        job.samples.append(s)
                        job.by_key[(ep, i)] = s
                        rows.append((job_id, ep, i, order, _pack(n.token_ids), _pack(n.loss_mask), n.label,
                                     n.expected_bytes, s.state.value, 0, None, 0, "[]", len(n.token_ids)))  # fmt: skip
                        order += 1
                self._db.executemany("INSERT INTO samples VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            self._queue.extend(job.samples)
            self.jobs[job_id] = job
            return job

    def get(self, key: P.SampleKey) -> Sample | None:
        job = self.jobs.get(key.job)
        return None if job is None else job.by_key.get((key.epoch, key.index))

    def cancel_job(self, job_id: str) -> list[str]:
        """Cancel every unfinished sample; returns spool files to delete. Samples in flight in
        vLLM are cancelled too: their late notices find them CANCELLED and are discarded."""
        files = []
        with self._lock:
            job = self.jobs[job_id]
            with self._tx():
                for s in job.samples:
                    if s.state in TERMINAL:
                        continue
                    old = s.state
                    if s.state == State.submitted and s.notice is None:
                        self.reserved_bytes -= s.expected_bytes
                    self.reserved_bytes -= s.on_disk_bytes
                    if s.notice and s.notice.file and s.on_disk_bytes:
                        files.append(s.notice.file)
                    s.on_disk_bytes = 0
                    s.lease_owner = None
                    s.state = State.cancelled
                    job.n_terminal += 1
                    self._save(s, old)
                job.finished = job.finished or time.time()
                self._save_job(job)
        return files

    # ------------------------------------------------------------------ submission
    def next_to_submit(self, budget: int, max_ready: int | None = None, low_water: float = 0.75) -> Sample | None:
        """The next queued sample, if its expected bytes fit the spool budget now (and the
        ready-but-unconsumed count is under its limit).

        High/low watermarks: once either limit stops submission, it resumes only when usage
        has fallen to ``low_water`` of the limit, so vLLM gets batches rather than a trickle
        of one request per consumed sample."""
        with self._lock:
            if self._throttled:
                if self.reserved_bytes > low_water * budget or (
                    max_ready is not None and self.ready_count() > low_water * max_ready
                ):
                    return None
                self._throttled = False
            if max_ready is not None and self.ready_count() >= max_ready:
                self._throttled = True
                return None
            while self._queue:
                s = self._queue[0]
                if s.state != State.queued:
                    self._queue.popleft()
                    continue
                if self.reserved_bytes + s.expected_bytes > budget and self.reserved_bytes > 0:
                    self._throttled = True
                    return None
                self._queue.popleft()
                s.state = State.submitted
                s.submitted_at = time.monotonic()
                self.reserved_bytes += s.expected_bytes
                self._save(s, State.queued)
                return s
            return None

    def ready_count(self) -> int:
        return sum(1 for s in self._ready if s.state == State.ready)

    def requeue(self, key: P.SampleKey, attempt: int, reason: str, *, count_attempt: bool = True) -> None:
        """vLLM refused, errored or timed out: retry with a new attempt, or fail for good.

        ``count_attempt=False`` is for vLLM being unreachable: not the sample's fault, so it
        waits without using up its attempts (the submitter bounds the wait by a deadline)."""
        with self._lock:
            smp = self.get(key)
            if smp is None or smp.state != State.submitted or smp.attempt != attempt:
                return
            self._unreserve_submitted(smp)
            if count_attempt:
                self._retry(smp, reason, State.submitted)
            else:
                smp.attempt += 1  # a late answer to the old request must not count
                self._reset_prompt(smp)
                smp.state = State.queued
                self._queue.appendleft(smp)
                self._save(smp, State.submitted)

    def _unreserve_submitted(self, smp: Sample) -> None:
        """A SUBMITTED sample leaves that state: release what it holds (its estimate, or, if
        its file already came in regenerate mode, the file, which the reaper removes)."""
        if smp.notice is not None:
            self.reserved_bytes -= smp.on_disk_bytes
            smp.notice, smp.on_disk_bytes = None, 0
        else:
            self.reserved_bytes -= smp.expected_bytes

    def fail(self, key: P.SampleKey, reason: str) -> None:
        with self._lock:
            s = self.get(key)
            if s is None or s.state in TERMINAL:
                return
            old = s.state
            if old == State.submitted:
                self._unreserve_submitted(s)
            s.errors.append(reason)
            self._finish(s, State.failed, old)

    def _retry(self, smp: Sample, reason: str, old: State) -> None:
        smp.errors.append(f"attempt {smp.attempt}: {reason}")
        smp.attempt += 1  # the request generation: late answers to older ones are discarded
        if len(smp.errors) >= self.max_attempts:  # failures, not generations, use up attempts
            self._finish(smp, State.failed, old)
        else:
            self._reset_prompt(smp)
            smp.state = State.queued
            self._queue.append(smp)
            self._save(smp, old)

    def _finish(self, smp: Sample, state: State, old: State) -> None:
        smp.state = state
        self._save(smp, old)
        job = self.jobs[smp.key.job]
        job.n_terminal += 1
        if job.finished is None and job.done:
            job.finished = time.time()
        self._save_job(job)

    def responded(self, key: P.SampleKey, attempt: int) -> None:
        """vLLM answered the request: the notice is due from now on. The notice timeout counts
        from here, not from submission, so a request slower than the timeout does not race
        its own notice."""
        with self._lock:
            smp = self.get(key)
            if smp is not None and smp.state == State.submitted and smp.attempt == attempt:
                smp.submitted_at = time.monotonic()

    def stale_submissions(self, older_than_s: float) -> list[Sample]:
        """SUBMITTED samples with no notice for too long (lost request, dead connector); the
        time counts from vLLM's response (``responded``) once there is one."""
        now = time.monotonic()
        with self._lock:
            return [s for j in self.jobs.values() for s in j.samples
                    if s.state == State.submitted and now - s.submitted_at > older_than_s]  # fmt: skip

    # ------------------------------------------------------------------ notices
    def on_notice(self, n: P.Notice, file_bytes: int) -> str:
        """Apply a connector notice; returns what to do with its file: 'keep' or 'delete'."""
        with self._lock:
            smp = self.get(n.key) if n.key else None
            if smp is None or smp.attempt != n.attempt or smp.state != State.submitted:
                return "delete"  # unknown, cancelled, or a late notice for an older attempt
            if smp.notice is not None:
                return "keep" if smp.notice.file == n.file else "delete"  # a repeat: changes nothing
            self.reserved_bytes -= smp.expected_bytes
            if n.status != P.NoticeStatus.ok:
                self._retry(smp, n.reason or "connector error", State.submitted)
                return "delete"
            smp.notice = n
            smp.on_disk_bytes = file_bytes
            self.reserved_bytes += file_bytes
            if self.jobs[smp.key.job].sampling is not None and not smp.generated:
                self._save(smp)  # regenerate mode: READY once vLLM's reply (the token ids) is known
                return "keep"
            self._make_ready(smp)
            return "keep"

    def _make_ready(self, smp: Sample) -> None:
        smp.state = State.ready
        self._ready.append(smp)
        self._save(smp, State.submitted)

    def set_generated(self, key: P.SampleKey, attempt: int, output_ids: list[int]) -> None:
        """Regenerate mode: vLLM's reply is in. The file holds prompt + reply − 1 positions
        (the last generated token was never fed back); the loss mask covers the reply."""
        with self._lock:
            smp = self.get(key)
            if smp is None or smp.state != State.submitted or smp.attempt != attempt or smp.generated:
                return
            keep = output_ids[:-1]
            smp.token_ids = smp.token_ids + keep
            smp.loss_mask = (smp.loss_mask or [0] * (len(smp.token_ids) - len(keep))) + [1] * len(keep)
            smp.generated = True
            self._db.execute("UPDATE samples SET token_ids=?, loss_mask=? WHERE job_id=? AND epoch=? AND idx=?",
                             (_pack(smp.token_ids), _pack(smp.loss_mask), key.job, key.epoch, key.index))  # fmt: skip
            if smp.notice is not None:
                self._make_ready(smp)

    # ------------------------------------------------------------------ delivery
    def lease_next(self, owner: bytes, jobs: list[str] | None) -> Sample | None:
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
                self._save(s, State.ready)
                return s
            return None

    def received(self, owner: bytes, key: P.SampleKey) -> int:
        """The trainer holds the bytes and the file is gone: its spool bytes are free again.

        From a trainer that no longer holds the lease (it lapsed, or we restarted), the file
        is gone all the same: the sample is produced again rather than offered to another
        trainer with no file behind it (its ack, if it comes, still counts once)."""
        with self._lock:
            s = self.get(key)
            if s is None or s.on_disk_bytes == 0:
                return 0
            if s.lease_owner != owner:
                if s.lease_owner is None and s.state == State.ready:
                    self.file_lost(key)
                return 0
            freed, s.on_disk_bytes = s.on_disk_bytes, 0
            self.reserved_bytes -= freed
            self._save(s)
            return freed

    def ack(self, owner: bytes, key: P.SampleKey) -> bool:
        """First ack wins; a repeated ack, or one for a sample another trainer holds, changes
        nothing. An ack for a sample no one holds (the trainer used it before a sidecar
        restart) is accepted: it was consumed, once."""
        with self._lock:
            s = self.get(key)
            if s is None or s.state in TERMINAL:
                return False
            if s.lease_owner is not None and s.lease_owner != owner:
                return False
            old = s.state
            if old == State.submitted and s.notice is None:
                self.reserved_bytes -= s.expected_bytes
            self.reserved_bytes -= s.on_disk_bytes
            s.on_disk_bytes = 0
            s.lease_owner = None
            job = self.jobs[key.job]
            job.tokens_consumed += len(s.token_ids)
            job.bytes_consumed += s.notice.nbytes if s.notice else 0
            self._finish(s, State.consumed, old)
            return True

    def ack_many(self, owner: bytes, keys: list[P.SampleKey]) -> tuple[int, int]:
        """Apply one ACK message as a whole: all its keys, in one transaction, or none (an error
        part-way rolls back the database and the in-memory state alike, then propagates).
        Returns (acked, ignored as repeats or not this trainer's)."""
        with self._lock:
            samples = [s for k in keys if (s := self.get(k)) is not None]
            jobs = {s.key.job: self.jobs[s.key.job] for s in samples}
            saved = ([(s, s.state, s.on_disk_bytes, s.lease_owner) for s in samples],
                     [(j, j.tokens_consumed, j.bytes_consumed, j.n_terminal, j.finished) for j in jobs.values()],
                     self.reserved_bytes)  # fmt: skip
            try:
                with self._tx():
                    acked = sum(self.ack(owner, k) for k in keys)
            except BaseException:
                for smp, state, on_disk, lease in saved[0]:
                    smp.state, smp.on_disk_bytes, smp.lease_owner = state, on_disk, lease
                for j, tok, nb, nt, fin in saved[1]:
                    j.tokens_consumed, j.bytes_consumed, j.n_terminal, j.finished = tok, nb, nt, fin
                self.reserved_bytes = saved[2]
                raise
            return acked, len(keys) - acked

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
            self._retry(s, f"trainer: {reason}", State.leased)
            return f

    def release_owner(self, owner: bytes, file_exists: Callable[[str], bool]) -> int:
        """A trainer went away: its leases go back to READY if the file is there, else QUEUED."""
        n = 0
        with self._lock:
            for job in self.jobs.values():
                for s in job.samples:
                    if s.state == State.leased and s.lease_owner == owner:
                        n += 1
                        s.lease_owner = None
                        if s.on_disk_bytes and s.notice and s.notice.file and file_exists(s.notice.file):
                            s.state = State.ready
                            self._ready.appendleft(s)
                        else:
                            self.reserved_bytes -= s.on_disk_bytes
                            s.on_disk_bytes = 0
                            s.notice = None
                            s.attempt += 1
                            self._reset_prompt(s)
                            s.state = State.queued
                            self._queue.appendleft(s)
                        self._save(s, State.leased)
        return n

    def file_lost(self, key: P.SampleKey) -> None:
        """A READY/LEASED sample's file vanished: produce it again (not the sample's fault)."""
        with self._lock:
            s = self.get(key)
            if s is None or s.state not in (State.ready, State.leased):
                return
            old = s.state
            self.reserved_bytes -= s.on_disk_bytes
            s.on_disk_bytes, s.notice, s.lease_owner = 0, None, None
            s.attempt += 1
            self._reset_prompt(s)
            s.state = State.queued
            self._queue.appendleft(s)
            self._save(s, old)

    def jobs_done(self, jobs: Iterable[str] | None) -> bool:
        with self._lock:
            jobs = list(jobs) if jobs else None
            sel = [self.jobs[j] for j in jobs if j in self.jobs] if jobs else list(self.jobs.values())
            if jobs and len(sel) != len(jobs):
                return False
            return bool(sel) and all(j.done for j in sel)

    def close(self) -> None:
        with self._lock:
            self._db.close()
