"""A job's life in the ledger: admitted (its rows written), cancelled, compacted.

Each of these touches rows in proportion to the job's size, so each works a chunk at a time
with the lock released between chunks: a big job never holds up the notice and delivery
threads or a status read for long.
"""

from __future__ import annotations

import json
import random
import time
import uuid

from server.ledger.core import ADMITTING, LedgerCore
from server.ledger.rows import Job, NewSample
from server.ledger.states import State
from server.ledger.store import pack

#: Rows one transaction of :meth:`Jobs.add_job` writes (the lock is held meanwhile).
ADD_BATCH = 2000


class Jobs(LedgerCore):
    def add_job(
        self, samples: list[NewSample], *, epochs: int = 1, seed: int = 0, meta: dict | None = None,
        sampling: dict | None = None, batch: int = ADD_BATCH,
    ) -> Job:  # fmt: skip
        """Queue a job. Each epoch submits the data again in a seeded shuffle (hidden states are
        regenerated, never stored), so epoch e of sample i has its own key (job, i, e).

        Rows go in ``batch`` at a time, each batch its own transaction with the lock released
        after it; its first samples may be submitted while the rest are written. Until the last
        batch the job is ``admitting`` (never done), and marked so on disk: a sidecar killed
        meanwhile drops it on restart (its client never got the id)."""
        job_id = uuid.uuid4().hex[:16]
        job = Job(job_id, sampling=sampling, admitting=True)
        meta = {**(meta or {}), "sampling": sampling}
        with self._lock, self._tx():
            self._db.execute("INSERT INTO jobs (job_id, created, meta) VALUES (?, ?, ?)",
                             (job_id, job.created, json.dumps({**meta, ADMITTING: True})))  # fmt: skip
            self.jobs[job_id] = job
        packed = [(pack(n.token_ids), pack(n.loss_mask)) for n in samples]
        order = 0
        for ep in range(epochs):
            idxs = list(range(len(samples)))
            if epochs > 1 or seed:
                random.Random(seed * 1_000_003 + ep).shuffle(idxs)
            for lo in range(0, len(idxs), batch):
                part = idxs[lo : lo + batch]
                with self._lock:
                    with self._tx():
                        q0 = self._qhi + 1
                        self._db.executemany(
                            "INSERT INTO samples (job_id, epoch, idx, ord, token_ids, loss_mask, label, "
                            "expected_bytes, state, attempt, notice, on_disk_bytes, errors, prompt_len, qpos) "
                            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                            ((job_id, ep, i, order + k, *packed[i], samples[i].label, samples[i].expected_bytes,
                              State.queued.value, 0, None, 0, None, len(samples[i].token_ids), q0 + k)
                             for k, i in enumerate(part)),
                        )  # fmt: skip
                    self._qhi += len(part)
                    order += len(part)
                    job.num_samples = order
                    job.state_counts[State.queued.value] += len(part)
                    self._tell(State.queued, None, len(part), 0)
                time.sleep(0)  # let a thread waiting for the lock have it before the next batch
        with self._lock, self._tx():
            self._db.execute("UPDATE jobs SET meta=? WHERE job_id=?", (json.dumps(meta), job_id))
            job.admitting = False
            if job.done:  # every sample already finished (cancelled) while the rest went in
                job.finished = job.finished or time.time()
                self._store.save_job(job)
        return job

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
