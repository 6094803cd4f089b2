"""A job's life in the ledger: admitted (staged, then queued), cancelled, compacted.

Each of these touches rows in proportion to the job's size, so each works a chunk at a time
with the lock released between chunks: a big job never holds up the notice and delivery
threads or a status read for long, and admitting one holds a chunk in memory, not the job.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from array import array
from collections.abc import Iterable
from itertools import islice

from server.ledger.core import ADMITTING, LedgerCore
from server.ledger.rows import Job, NewSample
from server.ledger.states import State
from server.ledger.store import pack

#: Rows one transaction of :meth:`Jobs.add_job` writes (the lock is held meanwhile).
ADD_BATCH = 2000


class JobWriter:
    """A job being admitted (:meth:`Jobs.begin_job`). Its samples go into ``staged_samples`` a
    chunk at a time as they come (:meth:`stage`), so memory holds one chunk, not the job; the
    job does not exist for anyone else yet. :meth:`commit` creates it and makes the samples
    QUEUED, epoch by epoch in the seeded shuffles, a batch per transaction; :meth:`drop` forgets
    them. From the commit's start to its end the job is ``admitting`` (never done), and marked so
    on disk: a sidecar killed meanwhile drops it, and any staged rows, on restart (its client
    never got the id)."""

    def __init__(self, led: Jobs, job: Job) -> None:
        self._led = led
        self.job = job
        self.n = 0  # samples staged

    def stage(self, samples: Iterable[NewSample]) -> None:
        """Stage a chunk (one transaction: keep it to a batch or so, the lock is held)."""
        led, i0 = self._led, self.n
        rows = [(self.job.job_id, i0 + k, pack(n.token_ids), pack(n.loss_mask), n.label, n.expected_bytes,
                 len(n.token_ids)) for k, n in enumerate(samples)]  # fmt: skip
        if not rows:
            return
        with led._lock, led._tx():  # noqa: SLF001
            led._db.executemany("INSERT INTO staged_samples (job_id, idx, token_ids, loss_mask, label, "  # noqa: SLF001
                                "expected_bytes, prompt_len) VALUES (?,?,?,?,?,?,?)", rows)  # fmt: skip
        self.n += len(rows)
        time.sleep(0)  # let a thread waiting for the lock have it before the next chunk

    def commit(self, *, epochs: int = 1, seed: int = 0, meta: dict | None = None, batch: int = ADD_BATCH) -> Job:
        """Queue the staged samples, ``epochs`` times: each epoch submits them again in a seeded
        shuffle, so epoch e of sample i has its own key (job, i, e). Its first samples may be
        submitted while the rest are written; the staged rows go with the last epoch's."""
        led, job, jid = self._led, self.job, self.job.job_id
        meta = {**(meta or {}), "sampling": job.sampling}
        with led._lock, led._tx():  # noqa: SLF001
            led._db.execute("INSERT INTO jobs (job_id, created, meta) VALUES (?, ?, ?)",  # noqa: SLF001
                            (jid, job.created, json.dumps({**meta, ADMITTING: True})))  # fmt: skip
            led.jobs[jid] = job
        move = ("INSERT INTO samples (job_id, epoch, idx, ord, token_ids, loss_mask, label, expected_bytes, state, "
                "attempt, notice, on_disk_bytes, errors, prompt_len, qpos) "
                "SELECT job_id, ?, idx, ?, token_ids, loss_mask, label, expected_bytes, ?, 0, NULL, 0, NULL, "
                "prompt_len, ? FROM staged_samples WHERE job_id=? AND idx=?")  # fmt: skip
        order = 0
        for ep in range(epochs):
            idxs = array("I", range(self.n))  # 4 bytes a sample, whatever the job's size
            if epochs > 1 or seed:
                random.Random(seed * 1_000_003 + ep).shuffle(idxs)
            for lo in range(0, self.n, batch):
                part = idxs[lo : lo + batch]
                with led._lock:  # noqa: SLF001
                    with led._tx():  # noqa: SLF001
                        q0 = led._qhi + 1  # noqa: SLF001
                        led._db.executemany(move, ((ep, order + k, State.queued.value, q0 + k, jid, i)  # noqa: SLF001
                                                   for k, i in enumerate(part)))  # fmt: skip
                        if ep == epochs - 1:
                            led._db.executemany("DELETE FROM staged_samples WHERE job_id=? AND idx=?",  # noqa: SLF001
                                                ((jid, i) for i in part))  # fmt: skip
                    led._qhi += len(part)  # noqa: SLF001
                    order += len(part)
                    job.num_samples = order
                    job.state_counts[State.queued.value] += len(part)
                    led._tell(State.queued, None, len(part), 0)  # noqa: SLF001
                time.sleep(0)  # let a thread waiting for the lock have it before the next batch
        with led._lock, led._tx():  # noqa: SLF001
            if epochs < 1:  # nothing was queued: the staged rows go here
                led._db.execute("DELETE FROM staged_samples WHERE job_id=?", (jid,))  # noqa: SLF001
            led._db.execute("UPDATE jobs SET meta=? WHERE job_id=?", (json.dumps(meta), jid))  # noqa: SLF001
            job.admitting = False
            if job.done:  # every sample already finished (cancelled) while the rest went in
                job.finished = job.finished or time.time()
                led._store.save_job(job)  # noqa: SLF001
        return job

    def drop(self, chunk: int = 5000) -> None:
        """Forget the staged samples (before :meth:`commit`), a chunk at a time."""
        led, jid = self._led, self.job.job_id
        for lo in range(0, self.n, chunk):
            with led._lock, led._tx():  # noqa: SLF001
                led._db.execute("DELETE FROM staged_samples WHERE job_id=? AND idx>=? AND idx<?",  # noqa: SLF001
                                (jid, lo, lo + chunk))  # fmt: skip
        self.n = 0


class Jobs(LedgerCore):
    def begin_job(self, *, sampling: dict | None = None) -> JobWriter:
        """A job to admit: stage its samples, then commit it (see :class:`JobWriter`)."""
        return JobWriter(self, Job(uuid.uuid4().hex[:16], sampling=sampling, admitting=True))

    def add_job(
        self, samples: Iterable[NewSample], *, epochs: int = 1, seed: int = 0, meta: dict | None = None,
        sampling: dict | None = None, batch: int = ADD_BATCH,
    ) -> Job:  # fmt: skip
        """Queue a job (:meth:`begin_job`, its samples staged ``batch`` at a time, commit)."""
        w = self.begin_job(sampling=sampling)
        it = iter(samples)
        while True:
            chunk = list(islice(it, batch))
            if not chunk:
                break
            w.stage(chunk)
            del chunk  # before the next is made: one chunk in memory at a time
        return w.commit(epochs=epochs, seed=seed, meta=meta, batch=batch)

    def cancel_job(self, job_id: str, chunk: int = 5000) -> list[str]:
        """Cancel every unfinished sample; returns spool files to delete. Samples in flight in
        vLLM are cancelled too: their late notices find them CANCELLED and are discarded."""
        files = []
        with self._lock:
            job = self.jobs[job_id]
            with self._tx():
                for s in [x for x in self._live.values() if x.key.job == job_id]:
                    if s.state == State.submitted and s.notice is None:
                        self.reserved_bytes -= s.expected_bytes
                    self.reserved_bytes -= s.on_disk_bytes
                    if s.notice and s.notice.file and s.on_disk_bytes:
                        files.append(s.notice.file)
                    s.on_disk_bytes = 0
                    s.lease_owner = None
                    s.state = State.cancelled
                    self._save(s)
                self._ready.pop(job_id, None)
            job.cancelling = True
            epochs, width = self._db.execute("SELECT max(epoch), max(idx) FROM samples WHERE job_id=?",
                                             (job_id,)).fetchone()  # fmt: skip
        # The queued rows a range of the primary key at a time, the lock released between them.
        for ep in range(-1 if epochs is None else epochs, -1, -1):
            for lo in range(0, (width or 0) + 1, chunk):
                with self._lock, self._tx():
                    n = self._db.execute(
                        "UPDATE samples SET state=? WHERE job_id=? AND epoch=? AND idx>=? AND idx<? AND state=?",
                        (State.cancelled.value, job_id, ep, lo, lo + chunk, State.queued.value),
                    ).rowcount
                    job.state_counts[State.queued.value] -= n
                    job.state_counts[State.cancelled.value] += n
                    if n:
                        self._tell(State.cancelled, State.queued, n, 0)
        with self._lock, self._tx():
            job.finished = job.finished or time.time()
            self._store.save_job(job)
        return files

    def compact(self, retention_s: float, now: float | None = None, chunk: int = 5000) -> list[str]:
        """Jobs finished more than ``retention_s`` ago keep a summary (counts, tokens) and lose
        their sample rows, deleted a chunk at a time so no call waits long for the lock."""
        now = time.time() if now is None else now
        with self._lock:
            old = [j for j in self.jobs.values()
                   if j.done and j.finished is not None and now - j.finished > retention_s]  # fmt: skip
        return self._compact(old, chunk)

    def purge(self, job_id: str, chunk: int = 5000) -> bool:
        """Compact a finished (e.g. cancelled) job now instead of after the retention: its rows,
        token ids and labels are deleted, its counts kept (``DELETE /v1/jobs/{id}?purge=true``,
        what ``hsstream proxy forget`` asks for the traffic it teed). False if it is not done."""
        with self._lock:
            j = self.jobs.get(job_id)
            if j is None or not j.done:
                return False
        self._compact([j], chunk)
        return True

    def _compact(self, old: list[Job], chunk: int) -> list[str]:
        with self._lock:
            old = [j for j in old if self.jobs.get(j.job_id) is j]
            for j in old:
                summary = {"num_samples": j.num_samples, "counts": j.counts(), "n_errors": j.n_errors}
                self._db.execute("UPDATE jobs SET summary=? WHERE job_id=?", (json.dumps(summary), j.job_id))
                del self.jobs[j.job_id]  # from here on, its samples are unknown keys
        for j in old:
            while True:
                with self._lock:
                    n = self._db.execute("DELETE FROM samples WHERE rowid IN (SELECT rowid FROM samples WHERE job_id=? "
                                         "LIMIT ?)", (j.job_id, chunk)).rowcount  # fmt: skip
                if n == 0:
                    break
        return [j.job_id for j in old]
