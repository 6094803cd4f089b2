"""What the proxy keeps of the traffic it tees (``state_dir/teed.sqlite``, 0600 in a 0700 folder).

Three things, each bounded in count and in time (``HSSTREAM_PROXY_RETENTION_S``):

* ``seen``: the content hashes of teed samples (no content), the newest ``dedup_window``, so a
  conversation seen again (a retry, a cached prompt at temperature 0) is not trained on twice,
  also across a restart;
* ``jobs``: the sidecar traffic jobs the proxy made (id, time, size), so what was teed can be
  found and deleted in the sidecar, and a job no trainer took is cancelled after the retention;
* ``heldout``: the held-out requests (their prompts, without the reply: content, private), the
  newest ``holdout_keep``, never sent for training; the swap's gate measures acceptance on them.

The training samples themselves are not kept here: they live in the sidecar's ledger until a
trainer consumed them and the sidecar's own retention (``HSSTREAM_JOB_RETENTION_S``) compacted
the job, or until ``hsstream proxy forget`` purges them. One connection under a lock: the tee's
thread writes, the admin routes read and delete from a worker thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS seen (digest TEXT PRIMARY KEY, t REAL);
CREATE INDEX IF NOT EXISTS seen_t ON seen(t);
CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, t REAL, n INTEGER, options_key TEXT, cancelled INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS heldout (digest TEXT PRIMARY KEY, t REAL, row TEXT, options_key TEXT);
CREATE INDEX IF NOT EXISTS heldout_t ON heldout(t);
"""


class TeedStore:
    def __init__(self, path: Path, *, dedup_window: int, holdout_keep: int, retention_s: float) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path.parent, 0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # created private, never world-readable
        os.close(fd)
        os.chmod(path, 0o600)
        self.path = path
        self.dedup_window, self.holdout_keep, self.retention_s = dedup_window, holdout_keep, retention_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ de-duplication
    def remember(self, digest: str, now: float | None = None) -> bool:
        """True the first time ``digest`` is seen (within the window), recording it; False after."""
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO seen (digest, t) VALUES (?, ?)", (digest, now or time.time()))
            return cur.rowcount == 1

    def forget_digest(self, digest: str) -> None:
        """Take back :meth:`remember` (the sample was dropped after all: it may come again)."""
        with self._lock:
            self._db.execute("DELETE FROM seen WHERE digest=?", (digest,))

    # ------------------------------------------------------------------ traffic jobs
    def add_job(self, job_id: str, n: int, options_key: str, now: float | None = None) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO jobs (job_id, t, n, options_key) VALUES (?, ?, ?, ?)",
                             (job_id, now or time.time(), n, options_key))  # fmt: skip

    def jobs(self, before: float | None = None) -> list[dict]:
        q, args = "SELECT job_id, t, n, options_key, cancelled FROM jobs", ()
        if before is not None:
            q, args = q + " WHERE t < ?", (before,)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY t", args).fetchall()
        return [{"job_id": j, "t": t, "n": n, "options_key": k, "cancelled": bool(c)} for j, t, n, k, c in rows]

    def mark_cancelled(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("UPDATE jobs SET cancelled=1 WHERE job_id=?", (job_id,))

    def drop_job(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))

    # ------------------------------------------------------------------ the held-out slice
    def hold_out(self, digest: str, row: dict, options_key: str, now: float | None = None) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO heldout (digest, t, row, options_key) VALUES (?, ?, ?, ?)",
                             (digest, now or time.time(), json.dumps(row), options_key))  # fmt: skip
            self._db.execute("DELETE FROM heldout WHERE digest NOT IN (SELECT digest FROM heldout ORDER BY t DESC "
                             "LIMIT ?)", (self.holdout_keep,))  # fmt: skip

    def heldout(self, limit: int | None = None) -> list[dict]:
        """The held-out slice, newest first: ``{"digest", "t", "row", "options_key"}``."""
        with self._lock:
            rows = self._db.execute("SELECT digest, t, row, options_key FROM heldout ORDER BY t DESC LIMIT ?",
                                    (limit if limit is not None else self.holdout_keep,)).fetchall()  # fmt: skip
        return [{"digest": d, "t": t, "row": json.loads(r), "options_key": k} for d, t, r, k in rows]

    # ------------------------------------------------------------------ bounds and deletion
    def prune(self, now: float | None = None) -> dict:
        """Apply the bounds: rows past the retention go, ``seen`` keeps the newest window.
        Returns what went (the jobs past the retention are returned, for the caller to cancel)."""
        now = now or time.time()
        cut = now - self.retention_s
        with self._lock:
            a = self._db.execute("DELETE FROM seen WHERE t < ?", (cut,)).rowcount
            a += self._db.execute("DELETE FROM seen WHERE digest NOT IN (SELECT digest FROM seen ORDER BY t DESC "
                                  "LIMIT ?)", (self.dedup_window,)).rowcount  # fmt: skip
            b = self._db.execute("DELETE FROM heldout WHERE t < ?", (cut,)).rowcount
        return {"seen": a, "heldout": b, "expired_jobs": self.jobs(before=cut)}

    def forget(self, before: float | None = None) -> dict:
        """Delete what was stored before ``before`` (None: everything); returns the counts and
        the traffic jobs whose rows went (for the caller to purge in the sidecar)."""
        jobs = self.jobs(before=before)
        with self._lock:
            if before is None:
                n = {t: self._db.execute(f"DELETE FROM {t}").rowcount for t in ("seen", "heldout", "jobs")}
            else:
                n = {t: self._db.execute(f"DELETE FROM {t} WHERE t < ?", (before,)).rowcount
                     for t in ("seen", "heldout", "jobs")}  # fmt: skip
        return {"deleted": n, "jobs": jobs}

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {t: self._db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("seen", "heldout", "jobs")}
