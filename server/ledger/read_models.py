"""What the REST routes, the metrics, the spool keeper and the delivery thread read: counts,
jobs, pages of rows. Nothing here changes a sample.

A read that spans several figures takes the lock once, so the figures come from one state
and add up (:meth:`ReadModels.snapshot`); a read over many rows takes it per chunk.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from server.ledger.core import LedgerCore
from server.ledger.rows import Job, SampleRow
from server.ledger.store import COLS, row_to_sample, unpack


@dataclass(frozen=True)
class JobFigures:
    job_id: str
    done: bool
    num_samples: int
    counts: dict[str, int]


@dataclass(frozen=True)
class Snapshot:
    """Every job's figures (oldest first), the READY count and the reserved spool bytes, all
    taken at one moment."""

    jobs: list[JobFigures]
    ready: int
    reserved_bytes: int


class ReadModels(LedgerCore):
    def snapshot(self) -> Snapshot:
        """One consistent view of the jobs, not torn by a transition (``GET /v1/overview``)."""
        with self._lock:
            jobs = [JobFigures(j.job_id, j.done, j.num_samples, j.counts()) for j in self.jobs.values()]
            return Snapshot(jobs, self._n_ready, self.reserved_bytes)

    def ready_count(self) -> int:
        return self._n_ready

    def in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    def live_files(self) -> set[str]:
        """Files the ledger still expects in the spool; anything else there is garbage."""
        with self._lock:
            return {s.notice.file for s in self._live.values() if s.notice and s.notice.file}

    def job_ids(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT job_id FROM jobs ORDER BY created")]

    def job_view(self, job_id: str) -> Job | None:
        """A job's counters: the live ones, or the summary of a compacted job."""
        with self._lock:
            if job_id in self.jobs:
                return self.jobs[job_id]
            row = self._db.execute("SELECT created, finished, tokens_consumed, bytes_consumed, summary FROM jobs "
                                   "WHERE job_id=? AND summary IS NOT NULL", (job_id,)).fetchone()  # fmt: skip
        if row is None:
            return None
        created, finished, tok, nb, summary = row
        sm = json.loads(summary)
        return Job(job_id, sm["num_samples"], created, finished, tok, nb, state_counts=Counter(sm["counts"]),
                   n_errors=sm["n_errors"], compacted=True)  # fmt: skip

    def job_meta(self, job_id: str) -> dict:
        """What a job's admission recorded (its options, skipped and repaired counts, warnings)."""
        with self._lock:
            row = self._db.execute("SELECT meta FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return json.loads(row[0] or "{}") if row else {}

    def jobs_done(self, jobs: Iterable[str] | None) -> bool:
        with self._lock:
            jobs = list(jobs) if jobs else None
            sel = [self.job_view(j) for j in jobs] if jobs else list(self.jobs.values())
            if jobs and not all(sel):
                return False
            return bool(sel) and all(j.done for j in sel)  # type: ignore[union-attr]

    def job_samples(self, job_id: str) -> list[SampleRow]:
        """Every sample of a job in submission order (the live objects where in flight).
        O(job): for tests and debugging, not for a hot path."""
        with self._lock:
            rows = self._db.execute(f"SELECT {COLS} FROM samples WHERE job_id=? ORDER BY ord", (job_id,)).fetchall()
            return [self._live.get(s.key) or s for s in map(row_to_sample, rows)]

    def errors_page(self, job_id: str, offset: int, limit: int) -> list[SampleRow]:
        """Samples of a job that have errors, in submission order (an indexed read)."""
        with self._lock:
            rows = self._db.execute(f"SELECT {COLS} FROM samples WHERE job_id=? AND errors IS NOT NULL "
                                    "ORDER BY ord LIMIT ? OFFSET ?", (job_id, limit, offset)).fetchall()  # fmt: skip
        return [row_to_sample(r) for r in rows]

    def samples_page(self, job_id: str, offset: int, limit: int, *, max_tokens: int,
                     pick: Callable[[str | None, int], bool] | None = None,
                     epoch: int = 0) -> tuple[list[tuple], int | None, int]:  # fmt: skip
        """A page of one epoch's samples from index ``offset`` on: (index, label, token ids, loss
        mask, prompt_len) of those ``pick(label, index)`` keeps (all without ``pick``), at most
        ``limit`` rows looked at and ``max_tokens`` tokens returned (a first sample is returned
        whatever its length), in index order; the index to read on from (None: the epoch is
        done); and the epoch's sample count. Read a chunk under the lock at a time; a row's token
        blob is unpacked only when it is returned."""
        out: list[tuple] = []
        tokens, last, looked = 0, offset - 1, 0
        while looked < limit:
            with self._lock:
                rows = self._db.execute(
                    "SELECT idx, label, token_ids, loss_mask, prompt_len FROM samples WHERE job_id=? AND epoch=? "
                    "AND idx>? ORDER BY idx LIMIT ?",
                    (job_id, epoch, last, min(1000, limit - looked)),
                ).fetchall()
            if not rows:
                return out, None, self._epoch_size(job_id, epoch)
            for idx, label, ids, mask, plen in rows:
                if pick is None or pick(label, idx):
                    t = unpack(ids) or []
                    if out and tokens + len(t) > max_tokens:
                        return out, idx, self._epoch_size(job_id, epoch)
                    tokens += len(t)
                    out.append((idx, label, t, unpack(mask), plen))
                last = idx
                looked += 1
        return out, last + 1, self._epoch_size(job_id, epoch)

    def _epoch_size(self, job_id: str, epoch: int) -> int:
        with self._lock:  # a range count over the primary key (job_id, epoch, idx)
            return self._db.execute("SELECT COUNT(*) FROM samples WHERE job_id=? AND epoch=?",
                                    (job_id, epoch)).fetchone()[0]  # fmt: skip

    def iter_token_ids(
        self, job_id: str, epoch: int = 0, chunk: int = 1000
    ) -> Iterable[tuple[list[int], list[int] | None]]:
        """(token ids, loss mask) of one epoch of a job, read in chunks: the lock is held per
        chunk, never for the whole job."""
        last = -1
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT idx, token_ids, loss_mask FROM samples WHERE job_id=? AND epoch=? AND idx>? "
                    "ORDER BY idx LIMIT ?",
                    (job_id, epoch, last, chunk),
                ).fetchall()
            if not rows:
                return
            for idx, ids, mask in rows:
                last = idx
                yield unpack(ids) or [], unpack(mask)
