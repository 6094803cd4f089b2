"""Every sample's state: the single source of truth for "nothing lost, nothing counted twice".

QUEUED → SUBMITTED → READY → LEASED → CONSUMED, or FAILED / CANCELLED. The submitter, the
notice thread and the delivery thread all move samples through here under one lock, so each
transition is checked against the current state and attempt (a late notice for an old
attempt cannot resurrect a sample; a second ack cannot count twice).

Every transition is written through to SQLite (WAL) before the lock is released, so a
sidecar killed at any moment restarts from a state it had really reached. A thread with
several transitions at hand (the notices that arrived together, the messages of one poll, the
leases of one delivery pass) applies them in one :meth:`Ledger.group`: one transaction, one
commit instead of one per transition, and the lock held until it is on disk, so no other
thread, REST call or trainer hears of a state before it is durable. On restart,
SUBMITTED and LEASED samples cannot be trusted (the request or the trainer may be gone) and
are recovered: see :meth:`Ledger.recover`.

Memory is O(in flight), not O(samples): SQLite holds every sample (token ids, masks, errors)
and the queue (ordered by ``qpos``); only SUBMITTED / READY / LEASED samples are objects in
RAM, bounded by the spool budget, ``max_ready`` and the submit concurrency. Per-job counts
are kept incrementally, so nothing on a hot path scans all samples. Finished jobs are
compacted after a retention: their rows go, a summary stays.
"""

from __future__ import annotations

import json
import os
import hmac
import random
import secrets
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


#: Rows one transaction of :meth:`Ledger.add_job` writes (the lock is held meanwhile).
ADD_BATCH = 2000
#: In a job's meta while its rows are being written: a job still so marked at restart is dropped.
ADMITTING = "admitting"

TERMINAL = {State.consumed, State.failed, State.cancelled}
IN_FLIGHT = (State.submitted, State.ready, State.leased)


@dataclass
class Sample:
    """One sample as an object: in flight (kept in RAM), or loaded from SQLite for one call."""

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
    #: The secret of the sample's latest lease (its DELIVER carried it): what proves a trainer
    #: held it. Kept, on disk too, until the next lease, so the trainer can still settle it
    #: after its lease lapsed or the sidecar restarted.
    lease_token: str | None = None
    submitted_at: float = 0.0
    errors: list[str] = field(default_factory=list)
    generated: bool = False  # regenerate mode: vLLM's reply is known (token ids final)
    prompt_len: int = -1  # regenerate mode: token_ids beyond this are vLLM's reply
    qpos: int = 0  # place in the queue while QUEUED
    saved: State | None = None  # the state SQLite holds (per-job counts follow it)
    # The notice as JSON, made once per notice rather than at each of its transitions.
    _notice_json: tuple[P.Notice, str] | None = field(default=None, repr=False, compare=False)

    def notice_json(self) -> str | None:
        if self.notice is None:
            return None
        if self._notice_json is None or self._notice_json[0] is not self.notice:
            self._notice_json = (self.notice, self.notice.model_dump_json())
        return self._notice_json[1]


@dataclass
class Job:
    """A job's counters, kept incrementally so status, metrics and the delivery thread's
    completion check are O(1) per job, whatever its size."""

    job_id: str
    num_samples: int = 0
    created: float = field(default_factory=time.time)
    finished: float | None = None
    tokens_consumed: int = 0
    bytes_consumed: int = 0
    sampling: dict | None = None  # regenerate mode: vLLM writes the reply with these
    state_counts: Counter = field(default_factory=Counter, repr=False)
    n_errors: int = 0  # samples with at least one error
    compacted: bool = False  # rows deleted after the retention; the counts are a summary
    admitting: bool = False  # its rows are still being written (a batch at a time): not done whatever the counts
    cancelling: bool = False  # cancelled: its queued rows are being marked a chunk at a time; none is submitted

    def counts(self) -> dict[str, int]:
        return {st.value: self.state_counts.get(st.value, 0) for st in State}

    @property
    def n_terminal(self) -> int:
        return sum(self.state_counts.get(st.value, 0) for st in TERMINAL)

    @property
    def done(self) -> bool:
        return not self.admitting and self.n_terminal == self.num_samples


@dataclass
class NewSample:
    token_ids: list[int]
    loss_mask: list[int] | None
    label: str | None
    expected_bytes: int


# errors is NULL while a sample has none, so the partial index below finds the few that do.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, created REAL, finished REAL, tokens_consumed INTEGER DEFAULT 0,
  bytes_consumed INTEGER DEFAULT 0, meta TEXT, summary TEXT);
CREATE TABLE IF NOT EXISTS samples (
  job_id TEXT, epoch INTEGER, idx INTEGER, ord INTEGER, token_ids BLOB, loss_mask BLOB, label TEXT,
  expected_bytes INTEGER, state TEXT, attempt INTEGER, notice TEXT, on_disk_bytes INTEGER, errors TEXT,
  prompt_len INTEGER, qpos INTEGER, lease_token TEXT, PRIMARY KEY (job_id, epoch, idx));
"""
_INDEXES = """
CREATE INDEX IF NOT EXISTS samples_queue ON samples(qpos) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS samples_in_flight ON samples(job_id, ord) WHERE state IN ('submitted', 'ready', 'leased');
CREATE INDEX IF NOT EXISTS samples_errors ON samples(job_id, ord) WHERE errors IS NOT NULL;
"""
_COLS = ("job_id, epoch, idx, token_ids, loss_mask, label, expected_bytes, state, attempt, notice, on_disk_bytes, "
         "errors, prompt_len, qpos, lease_token")  # fmt: skip


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def _to_v1(db: sqlite3.Connection) -> None:
    """Files of before the schema had a version: the queue (``qpos``) and the job summaries
    moved into SQLite at some point of those releases, so each is added where it is missing."""
    if "qpos" not in _columns(db, "samples"):
        db.execute("ALTER TABLE samples ADD COLUMN qpos INTEGER")
        db.execute("UPDATE samples SET qpos = ord")
        db.execute("UPDATE samples SET errors = NULL WHERE errors = '[]'")
    if "summary" not in _columns(db, "jobs"):
        db.execute("ALTER TABLE jobs ADD COLUMN summary TEXT")


def _to_v2(db: sqlite3.Connection) -> None:
    """The lease token. Samples leased before have none: no trainer can settle those leases
    (a trainer of the older protocol is refused anyway); they are recovered and leased again."""
    db.execute("ALTER TABLE samples ADD COLUMN lease_token TEXT")


#: ``_MIGRATIONS[v]`` brings a file of schema version ``v`` (``PRAGMA user_version``) to ``v + 1``.
#: Append only: a released step never changes, since files it already upgraded exist.
_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_to_v1, _to_v2)
SCHEMA_VERSION = len(_MIGRATIONS)


def _pack(ids: list[int] | None) -> bytes | None:
    return None if ids is None else array("i", ids).tobytes()


def _unpack(b: bytes | None) -> list[int] | None:
    if b is None:
        return None
    a = array("i")
    a.frombytes(b)
    return a.tolist()


def _sample(row: tuple) -> Sample:
    jid, ep, idx, ids, mask, label, eb, st, att, notice, odb, errs, plen, qpos, token = row
    s = Sample(P.SampleKey(job=jid, epoch=ep, index=idx), _unpack(ids) or [], _unpack(mask), label, eb, State(st), att,
               P.Notice.model_validate_json(notice) if notice else None, odb or 0, lease_token=token,
               errors=json.loads(errs) if errs else [], prompt_len=plen if plen is not None else -1,
               qpos=qpos or 0, saved=State(st))  # fmt: skip
    s.generated = s.prompt_len >= 0 and len(s.token_ids) > s.prompt_len
    return s


# A listener hears (new state, old state or None for a new sample, how many samples, their tokens).
Listener = Callable[[State, "State | None", int, int], None]


class Ledger:
    def __init__(self, path: str | Path | None = None, max_attempts: int = 3) -> None:
        self.max_attempts = max_attempts
        self.jobs: dict[str, Job] = {}  # jobs not yet compacted
        self._lock = threading.RLock()
        self._live: dict[P.SampleKey, Sample] = {}  # SUBMITTED / READY / LEASED
        # READY samples per job, oldest first; may hold samples that left READY (skipped when
        # met). Per job, so a trainer asking for one job never walks another job's samples.
        self._ready: dict[str, deque[Sample]] = {}
        self._n_ready = 0
        self._qlo = self._qhi = 0  # queue positions: appendleft below qlo, append above qhi
        self.reserved_bytes = 0  # expected bytes of SUBMITTED + real bytes of files on disk
        self._throttled = False  # a limit was hit: wait for the low watermark
        self.path = str(path) if path else ":memory:"
        if path and not os.path.exists(self.path):
            # It holds the users' prompts (token ids): private from its creation, in a private
            # directory (the state dir may not exist yet); SQLite gives its -wal and -shm files
            # the database file's mode.
            Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._in_tx = False  # a transaction is open (under the lock): _tx nests as a savepoint
        self._migrate()
        self._db.executescript(_INDEXES)
        self.listeners: list[Listener] = []
        self._deferred: list[tuple] | None = None  # listener events held back by ack_many

    def _migrate(self) -> None:
        """A new file gets today's schema; an older one is brought to it a step at a time
        (``_MIGRATIONS``), each step with its new version in one transaction. A file of a newer
        release is refused: this code does not know what its columns mean."""
        have = self._db.execute("PRAGMA user_version").fetchone()[0]
        if have > SCHEMA_VERSION:
            raise RuntimeError(f"ledger {self.path} has schema version {have}, newer than this release's "
                               f"{SCHEMA_VERSION}: run the hsstream release that wrote it")  # fmt: skip
        new = not self._db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='samples'").fetchone()
        if new:
            with self._tx():
                for stmt in filter(str.strip, _SCHEMA.split(";")):
                    self._db.execute(stmt)
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            return
        for version in range(have, SCHEMA_VERSION):
            with self._tx():
                _MIGRATIONS[version](self._db)
                self._db.execute(f"PRAGMA user_version = {version + 1}")

    def is_open(self) -> bool:
        try:
            self._db.execute("SELECT 1")
            return True
        except sqlite3.Error:
            return False

    # ------------------------------------------------------------------ persistence
    def _save(self, s: Sample) -> None:
        """Write a sample through, move it between RAM and SQLite-only, and keep the counts."""
        self._db.execute(
            "UPDATE samples SET state=?, attempt=?, notice=?, on_disk_bytes=?, errors=?, qpos=?, lease_token=? "
            "WHERE job_id=? AND epoch=? AND idx=?",
            (s.state.value, s.attempt, s.notice_json(), s.on_disk_bytes,
             json.dumps(s.errors) if s.errors else None, s.qpos, s.lease_token, s.key.job, s.key.epoch, s.key.index),
        )  # fmt: skip
        if s.state in IN_FLIGHT:
            self._live[s.key] = s
        else:
            self._live.pop(s.key, None)
        old = s.saved
        if old == s.state:
            return
        s.saved = s.state
        self._n_ready += (s.state == State.ready) - (old == State.ready)
        job = self.jobs.get(s.key.job)
        if job is not None:
            if old is not None:
                job.state_counts[old.value] -= 1
            job.state_counts[s.state.value] += 1
        if self._deferred is not None:  # inside ack_many: heard only once it commits
            self._deferred.append((s.state, old, 1, len(s.token_ids)))
            return
        for fn in self.listeners:
            fn(s.state, old, 1, len(s.token_ids))

    def _load(self, key: P.SampleKey) -> Sample | None:
        row = self._db.execute(f"SELECT {_COLS} FROM samples WHERE job_id=? AND epoch=? AND idx=?",
                               (key.job, key.epoch, key.index)).fetchone()  # fmt: skip
        return None if row is None else _sample(row)

    @contextmanager
    def _tx(self):  # noqa: ANN202
        """One transaction; rolled back on error so the connection never stays inside one.
        Inside a :meth:`group` it is a savepoint: rolled back alone, committed with the group."""
        if self._in_tx:
            self._db.execute("SAVEPOINT tx")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK TO tx")
                self._db.execute("RELEASE tx")
                raise
            self._db.execute("RELEASE tx")
            return
        self._db.execute("BEGIN")
        self._in_tx = True
        try:
            yield
        except BaseException:
            self._in_tx = False
            self._db.execute("ROLLBACK")
            raise
        self._in_tx = False
        self._commit()

    def _commit(self) -> None:
        """COMMIT; if it fails, the connection is left outside any transaction (SQLite rolls
        back itself on a full disk or an I/O error; anything else is rolled back here)."""
        try:
            self._db.execute("COMMIT")
        except BaseException:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # already rolled back by SQLite
            raise

    @contextmanager
    def group(self):  # noqa: ANN202
        """Several transitions, one commit: the lock is held from the first to the commit, so
        nothing outside the group sees a state SQLite does not hold yet (REST reads take the
        lock too). On an error part-way, what was applied is committed (as if each transition
        had committed alone, which is what happens outside a group) and the error propagates.
        A group inside a transaction joins it."""
        with self._lock:
            if self._in_tx:
                yield
                return
            self._db.execute("BEGIN")
            self._in_tx = True
            try:
                yield
            finally:
                self._in_tx = False
                self._commit()

    def _enqueue(self, s: Sample, *, front: bool = False) -> None:
        """QUEUED again; the caller saves. At the front for samples that were already under way."""
        if front:
            self._qlo -= 1
            s.qpos = self._qlo
        else:
            self._qhi += 1
            s.qpos = self._qhi
        s.state = State.queued

    def _add_error(self, s: Sample, reason: str) -> None:
        if not s.errors and s.key.job in self.jobs:
            self.jobs[s.key.job].n_errors += 1
        s.errors.append(reason)

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
        else QUEUED (the trainer may have used it without acking: it is produced again).
        Only samples that were in flight are read; the rest stay in SQLite."""
        stats = Counter()
        with self._lock:
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
                f"SELECT {_COLS} FROM samples WHERE state IN ('submitted', 'ready', 'leased') ORDER BY job_id, ord"
            ).fetchall()
            with self._tx():
                for s in map(_sample, rows):
                    if s.state == State.submitted:
                        s.attempt += 1  # whatever comes back for the old attempt is discarded
                        s.notice, s.on_disk_bytes = None, 0  # an early (regenerate) file is stray now
                        self._reset_prompt(s)
                        self._enqueue(s, front=True)
                        stats["resubmitted"] += 1
                    elif s.notice and s.notice.file and file_exists(s.notice.file):
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
        return dict(stats)

    def live_files(self) -> set[str]:
        """Files the ledger still expects in the spool; anything else there is garbage."""
        with self._lock:
            return {s.notice.file for s in self._live.values() if s.notice and s.notice.file}

    def in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    # ------------------------------------------------------------------ jobs
    def add_job(
        self, samples: list[NewSample], *, epochs: int = 1, seed: int = 0, meta: dict | None = None,
        sampling: dict | None = None, batch: int = ADD_BATCH,
    ) -> Job:
        """Queue a job. Each epoch submits the data again in a seeded shuffle (hidden states are
        regenerated, never stored), so epoch e of sample i has its own key (job, i, e).

        Rows go in ``batch`` at a time, each batch its own transaction with the lock released
        after it, so a big job never holds up the notice and delivery threads or a status read
        for long; its first samples may be submitted while the rest are written. Until the last
        batch the job is ``admitting`` (never done), and marked so on disk: a sidecar killed
        meanwhile drops it on restart (its client never got the id)."""
        job_id = uuid.uuid4().hex[:16]
        job = Job(job_id, sampling=sampling, admitting=True)
        meta = {**(meta or {}), "sampling": sampling}
        with self._lock, self._tx():
            self._db.execute("INSERT INTO jobs (job_id, created, meta) VALUES (?, ?, ?)",
                             (job_id, job.created, json.dumps({**meta, ADMITTING: True})))  # fmt: skip
            self.jobs[job_id] = job
        packed = [(_pack(n.token_ids), _pack(n.loss_mask)) for n in samples]
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
                    for fn in self.listeners:
                        fn(State.queued, None, len(part), 0)
                time.sleep(0)  # let a thread waiting for the lock have it before the next batch
        with self._lock, self._tx():
            self._db.execute("UPDATE jobs SET meta=? WHERE job_id=?", (json.dumps(meta), job_id))
            job.admitting = False
            if job.done:  # every sample already finished (cancelled) while the rest went in
                job.finished = job.finished or time.time()
                self._save_job(job)
        return job

    def get(self, key: P.SampleKey) -> Sample | None:
        """The sample in flight, or a copy loaded from SQLite (changes to it must be saved)."""
        if key.job not in self.jobs:
            return None
        return self._live.get(key) or self._load(key)

    def job_samples(self, job_id: str) -> list[Sample]:
        """Every sample of a job in submission order (the live objects where in flight).
        O(job): for tests and debugging, not for a hot path."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLS} FROM samples WHERE job_id=? ORDER BY ord", (job_id,)).fetchall()
            return [self._live.get(s.key) or s for s in map(_sample, rows)]

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

    def job_ids(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT job_id FROM jobs ORDER BY created")]

    def errors_page(self, job_id: str, offset: int, limit: int) -> list[Sample]:
        """Samples of a job that have errors, in submission order (an indexed read)."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLS} FROM samples WHERE job_id=? AND errors IS NOT NULL "
                                    "ORDER BY ord LIMIT ? OFFSET ?", (job_id, limit, offset)).fetchall()  # fmt: skip
        return [_sample(r) for r in rows]

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
                yield _unpack(ids) or [], _unpack(mask)

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
        # The queued rows a range of the primary key at a time, the lock released between them,
        # so cancelling a big job never holds up the other threads for long.
        for ep in range(-1 if epochs is None else epochs, -1, -1):
            for lo in range(0, (width or 0) + 1, chunk):
                with self._lock, self._tx():
                    n = self._db.execute(
                        "UPDATE samples SET state=? WHERE job_id=? AND epoch=? AND idx>=? AND idx<? AND state=?",
                        (State.cancelled.value, job_id, ep, lo, lo + chunk, State.queued.value),
                    ).rowcount
                    job.state_counts[State.queued.value] -= n
                    job.state_counts[State.cancelled.value] += n
                    for fn in self.listeners if n else ():
                        fn(State.cancelled, State.queued, n, 0)
        with self._lock, self._tx():
            job.finished = job.finished or time.time()
            self._save_job(job)
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
                    max_ready is not None and self._n_ready > low_water * max_ready
                ):
                    return None
                self._throttled = False
            if max_ready is not None and self._n_ready >= max_ready:
                self._throttled = True
                return None
            head = f"SELECT {_COLS} FROM samples WHERE state = 'queued' ORDER BY qpos LIMIT 1"  # the queue index
            while True:
                row = self._db.execute(head).fetchone()
                if row is None:
                    return None
                s = _sample(row)
                if not ((job := self.jobs.get(s.key.job)) is not None and job.cancelling):
                    break
                s.state = State.cancelled  # its job's cancel has not reached this row yet
                self._save(s)
            if self.reserved_bytes + s.expected_bytes > budget and self.reserved_bytes > 0:
                self._throttled = True
                return None
            s.state = State.submitted
            s.submitted_at = time.monotonic()
            self.reserved_bytes += s.expected_bytes
            self._save(s)
            return s

    def _queued_chunks(self, chunk: int = 2000) -> Iterable[list[Sample]]:
        """QUEUED samples (they live in SQLite only) a chunk at a time. Yields with the lock
        held, so the caller may change and save them before any other thread sees them."""
        last = 0
        while True:
            with self._lock:
                rows = self._db.execute(f"SELECT rowid, {_COLS} FROM samples WHERE state = 'queued' AND rowid > ? "
                                        "ORDER BY rowid LIMIT ?", (last, chunk)).fetchall()  # fmt: skip
                if not rows:
                    return
                last = rows[-1][0]
                with self._tx():
                    yield [_sample(r[1:]) for r in rows]

    def reprice_queued(self, size_of: Callable[[Sample], int]) -> int:
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

    def fail_queued(self, reason_of: Callable[[Sample], str | None]) -> int:
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

    def ready_count(self) -> int:
        return self._n_ready

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
                smp.attempt += 1  # a late answer to the old request must not count
                self._reset_prompt(smp)
                self._enqueue(smp, front=True)
                self._save(smp)

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
            if s.state == State.submitted:
                self._unreserve_submitted(s)
            self._add_error(s, reason)
            self._finish(s, State.failed)

    def _retry(self, smp: Sample, reason: str) -> None:
        self._add_error(smp, f"attempt {smp.attempt}: {reason}")
        smp.attempt += 1  # the request generation: late answers to older ones are discarded
        if len(smp.errors) >= self.max_attempts:  # failures, not generations, use up attempts
            self._finish(smp, State.failed)
        else:
            self._reset_prompt(smp)
            self._enqueue(smp)
            self._save(smp)

    def _finish(self, smp: Sample, state: State) -> None:
        smp.state = state
        self._save(smp)
        job = self.jobs[smp.key.job]
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
            return [s for s in self._live.values()
                    if s.state == State.submitted and now - s.submitted_at > older_than_s]  # fmt: skip

    # ------------------------------------------------------------------ notices
    def on_notice(self, n: P.Notice, file_bytes: int) -> str:
        """Apply a connector notice; returns what to do with its file: 'keep' or 'delete'."""
        with self._lock:
            smp = self._live.get(n.key) if n.key else None
            if smp is None or smp.attempt != n.attempt or smp.state != State.submitted:
                return "delete"  # unknown, cancelled, or a late notice for an older attempt
            if smp.notice is not None:
                return "keep" if smp.notice.file == n.file else "delete"  # a repeat: changes nothing
            self.reserved_bytes -= smp.expected_bytes
            if n.status == P.NoticeStatus.busy:  # the connector had no room: not the sample's fault
                smp.attempt += 1
                self._reset_prompt(smp)
                self._enqueue(smp)
                self._save(smp)
                return "delete"
            if n.status != P.NoticeStatus.ok:
                self._retry(smp, n.reason or "connector error")
                return "delete"
            smp.notice = n
            smp.on_disk_bytes = file_bytes
            self.reserved_bytes += file_bytes
            if self.jobs[smp.key.job].sampling is not None and not smp.generated:
                self._save(smp)  # regenerate mode: READY once vLLM's reply (the token ids) is known
                return "keep"
            self._make_ready(smp)
            return "keep"

    def _make_ready(self, smp: Sample, *, front: bool = False) -> None:
        smp.state = State.ready
        dq = self._ready.setdefault(smp.key.job, deque())
        if len(dq) > 2 * self._n_ready + 64:  # drop entries that left READY (lost files, acks without lease)
            dq = self._ready[smp.key.job] = deque(s for s in dq if s.state == State.ready)
        dq.appendleft(smp) if front else dq.append(smp)
        self._save(smp)

    def set_generated(self, key: P.SampleKey, attempt: int, output_ids: list[int]) -> None:
        """Regenerate mode: vLLM's reply is in. The file holds prompt + reply − 1 positions
        (the last generated token was never fed back); the loss mask covers the reply."""
        with self._lock:
            smp = self._live.get(key)
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
        """The oldest READY sample of the first of ``jobs`` (any job if None) that has one."""
        with self._lock:
            for job in list(self._ready) if jobs is None else jobs:
                dq = self._ready.get(job)
                while dq:
                    s = dq.popleft()
                    if s.state != State.ready:
                        continue
                    s.state = State.leased
                    s.lease_owner, s.lease_token = owner, secrets.token_hex(16)
                    self._save(s)
                    return s
                self._ready.pop(job, None)
            return None

    def lease_many(self, owner: bytes, jobs: list[str] | None, n: int) -> list[Sample]:
        """Up to ``n`` samples as :meth:`lease_next` gives them, in one transaction: the caller
        sends them once this returns, so every lease a trainer hears of is on disk. If the write
        fails, none is leased: they are READY again, at the front, and the error propagates."""
        out: list[Sample] = []
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
                            s.state = State.leased
                            s.lease_owner, s.lease_token = owner, secrets.token_hex(16)
                            self._save(s)
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
        stays READY: taking it for lost would drop the new file from the ledger, left in the
        spool for the reaper (what `make test` once saw). ``file_exists`` None: cannot tell,
        taken as gone."""
        with self._lock:
            s = self._live.get(key)
            if s is None or s.on_disk_bytes == 0 or not self.holds(key, token):
                return 0
            if s.lease_owner != owner:
                if s.lease_owner is None and s.state == State.ready:
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
    ) -> tuple[int, int]:
        """Apply one ACK message as a whole: all its keys, in one transaction, or none (an error
        part-way rolls back the database and the in-memory state alike, then propagates).
        ``tokens[i]`` is ``keys[i]``'s lease token (see :meth:`ack`).
        Returns (acked, ignored as repeats or not this trainer's); the files the acks left
        without a reader are added to ``orphans`` (see :meth:`ack`), only if it applied."""
        with self._lock:
            samples = [s for k in keys if (s := self.get(k)) is not None]
            jobs = {s.key.job: self.jobs[s.key.job] for s in samples}
            saved = ([(s, s.state, s.saved, s.on_disk_bytes, s.lease_owner) for s in samples],
                     [(j, j.tokens_consumed, j.bytes_consumed, Counter(j.state_counts), j.finished)
                      for j in jobs.values()],
                     self.reserved_bytes, self._n_ready)  # fmt: skip
            self._deferred = []
            try:
                left: list[tuple[P.SampleKey, str]] = []
                with self._tx():
                    acked = sum(self.ack(owner, k, t, left) for k, t in zip(keys, tokens, strict=True))
            except BaseException:
                for smp, state, was_saved, on_disk, lease in saved[0]:
                    smp.state, smp.saved, smp.on_disk_bytes, smp.lease_owner = state, was_saved, on_disk, lease
                    if state in IN_FLIGHT:
                        self._live[smp.key] = smp
                for j, tok, nb, counts, fin in saved[1]:
                    j.tokens_consumed, j.bytes_consumed, j.state_counts, j.finished = tok, nb, counts, fin
                self.reserved_bytes, self._n_ready = saved[2], saved[3]
                self._deferred = None
                raise
            self._tell_deferred()
            if orphans is not None:
                orphans.extend(left)
            return acked, len(keys) - acked

    def _tell_deferred(self) -> None:
        """The listeners hear the transitions of a group once it is on disk, never before."""
        events, self._deferred = self._deferred or [], None
        for ev in events:
            for fn in self.listeners:
                fn(*ev)

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
            self.received(owner, key, token)
            s.lease_owner = None
            f = s.notice.file if s.notice else None
            s.notice = None
            if not_received:
                s.attempt += 1
                self._reset_prompt(s)
                self._enqueue(s, front=True)
                self._save(s)
            else:
                self._retry(s, f"trainer: {reason}")
            return f

    def awaits_notice(self, key: P.SampleKey, attempt: int) -> bool:
        """True while ``key`` is SUBMITTED at ``attempt`` with no notice yet: a file of that
        attempt in the spool is this sample's, its notice still on the way."""
        with self._lock:
            s = self._live.get(key)
            return s is not None and s.state == State.submitted and s.attempt == attempt and s.notice is None

    def release_owner(self, owner: bytes, file_exists: Callable[[str], bool]) -> int:
        """A trainer went away: its leases go back to READY if the file is there, else QUEUED."""
        n = 0
        with self._lock:
            for s in [x for x in self._live.values() if x.state == State.leased and x.lease_owner == owner]:
                n += 1
                s.lease_owner = None
                if s.on_disk_bytes and s.notice and s.notice.file and file_exists(s.notice.file):
                    self._make_ready(s, front=True)
                    continue
                self.reserved_bytes -= s.on_disk_bytes
                s.on_disk_bytes = 0
                s.notice = None
                s.attempt += 1
                self._reset_prompt(s)
                self._enqueue(s, front=True)
                self._save(s)
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
                if s.on_disk_bytes and s.notice and s.notice.file and file_exists(s.notice.file):
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
            s.attempt += 1
            self._reset_prompt(s)
            self._enqueue(s, front=True)
            self._save(s)

    def jobs_done(self, jobs: Iterable[str] | None) -> bool:
        with self._lock:
            jobs = list(jobs) if jobs else None
            sel = [self.job_view(j) for j in jobs] if jobs else list(self.jobs.values())
            if jobs and not all(sel):
                return False
            return bool(sel) and all(j.done for j in sel)  # type: ignore[union-attr]

    def close(self) -> None:
        with self._lock:
            self._db.close()
