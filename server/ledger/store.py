"""The ledger's SQLite file: its creation, schema and upgrades, transactions, and the sample row
codec.

The schema version is SQLite's ``PRAGMA user_version``; ``_MIGRATIONS`` brings an older file to
it one step at a time. A later change to the schema appends a step (and its test opens a file
of the release before, ``tests/unit/server/test_ledger_schema.py``).

Writes go through the connection in WAL mode with ``synchronous=NORMAL``: a commit is durable
against a killed process, which is what the ledger's recovery needs.
"""

from __future__ import annotations

import json
import os
import sqlite3
from array import array
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from connector import protocol as P
from connector.contract.arena import Slot
from server.ledger.rows import Job, SampleRow
from server.ledger.states import State

# errors is NULL while a sample has none, so the partial index below finds the few that do.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, created REAL, finished REAL, tokens_consumed INTEGER DEFAULT 0,
  bytes_consumed INTEGER DEFAULT 0, meta TEXT, summary TEXT);
CREATE TABLE IF NOT EXISTS samples (
  job_id TEXT, epoch INTEGER, idx INTEGER, ord INTEGER, token_ids BLOB, loss_mask BLOB, label TEXT,
  expected_bytes INTEGER, state TEXT, attempt INTEGER, notice TEXT, on_disk_bytes INTEGER, errors TEXT,
  prompt_len INTEGER, qpos INTEGER, lease_token TEXT, slot TEXT, PRIMARY KEY (job_id, epoch, idx));
CREATE TABLE IF NOT EXISTS staged_samples (
  job_id TEXT, idx INTEGER, token_ids BLOB, loss_mask BLOB, label TEXT, expected_bytes INTEGER,
  prompt_len INTEGER, PRIMARY KEY (job_id, idx));
"""
_INDEXES = """
CREATE INDEX IF NOT EXISTS samples_queue ON samples(qpos) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS samples_in_flight ON samples(job_id, ord) WHERE state IN ('submitted', 'ready', 'leased');
CREATE INDEX IF NOT EXISTS samples_errors ON samples(job_id, ord) WHERE errors IS NOT NULL;
"""
#: The columns :func:`row_to_sample` reads, in its order.
COLS = ("job_id, epoch, idx, token_ids, loss_mask, label, expected_bytes, state, attempt, notice, on_disk_bytes, "
        "errors, prompt_len, qpos, lease_token, slot")  # fmt: skip


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def _to_v1(db: sqlite3.Connection) -> None:
    """Files of before the schema had a version: the queue (``qpos``) and the job summaries
    may be missing, so each is added where it is."""
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


def _to_v3(db: sqlite3.Connection) -> None:
    """The staging table a job's samples are written to as they are admitted, a chunk at a
    time, before any of them is a sample (``server/ledger/jobs.py``)."""
    db.execute("CREATE TABLE staged_samples (job_id TEXT, idx INTEGER, token_ids BLOB, loss_mask BLOB, label TEXT, "
               "expected_bytes INTEGER, prompt_len INTEGER, PRIMARY KEY (job_id, idx))")  # fmt: skip


def _to_v4(db: sqlite3.Connection) -> None:
    """The arena layout's slot table: each sample's slot (JSON of ``arena.Slot``) while it holds
    one. Files of before hold none, so no slot is taken after the upgrade."""
    db.execute("ALTER TABLE samples ADD COLUMN slot TEXT")


#: ``_MIGRATIONS[v]`` brings a file of schema version ``v`` (``PRAGMA user_version``) to ``v + 1``.
#: Append only: a released step never changes, since files it already upgraded exist.
_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_to_v1, _to_v2, _to_v3, _to_v4)
SCHEMA_VERSION = len(_MIGRATIONS)


def pack(ids: list[int] | None) -> bytes | None:
    return None if ids is None else array("i", ids).tobytes()


def unpack(b: bytes | None) -> list[int] | None:
    if b is None:
        return None
    a = array("i")
    a.frombytes(b)
    return a.tolist()


def row_to_sample(row: tuple) -> SampleRow:
    """A ``SELECT {COLS}`` row as a :class:`SampleRow` (``saved``: the state the row holds)."""
    jid, ep, idx, ids, mask, label, eb, st, att, notice, odb, errs, plen, qpos, token, slot = row
    s = SampleRow(P.SampleKey(job=jid, epoch=ep, index=idx), unpack(ids) or [], unpack(mask), label, eb, State(st),
                  att, P.Notice.model_validate_json(notice) if notice else None, odb or 0, lease_token=token,
                  errors=json.loads(errs) if errs else [], prompt_len=plen if plen is not None else -1,
                  qpos=qpos or 0, saved=State(st), slot=Slot.model_validate_json(slot) if slot else None)  # fmt: skip
    s.generated = s.prompt_len >= 0 and len(s.token_ids) > s.prompt_len
    return s


class Store:
    """The connection and its transactions. Not thread-safe by itself: the ledger's lock is held
    around every use."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = str(path) if path else ":memory:"
        if path and not os.path.exists(self.path):
            # It holds the users' prompts (token ids): private from its creation, in a private
            # directory (the state dir may not exist yet); SQLite gives its -wal and -shm files
            # the database file's mode.
            Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.in_tx = False  # a transaction is open (under the lock): tx() nests as a savepoint
        self._migrate()
        self.db.executescript(_INDEXES)

    def _migrate(self) -> None:
        """A new file gets today's schema; an older one is brought to it a step at a time
        (``_MIGRATIONS``), each step with its new version in one transaction. A file of a newer
        release is refused: this code does not know what its columns mean."""
        have = self.db.execute("PRAGMA user_version").fetchone()[0]
        if have > SCHEMA_VERSION:
            raise RuntimeError(f"ledger {self.path} has schema version {have}, newer than this release's "
                               f"{SCHEMA_VERSION}: run the hsstream release that wrote it")  # fmt: skip
        new = not self.db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='samples'").fetchone()
        if new:
            with self.tx():
                for stmt in filter(str.strip, _SCHEMA.split(";")):
                    self.db.execute(stmt)
                self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            return
        for version in range(have, SCHEMA_VERSION):
            with self.tx():
                _MIGRATIONS[version](self.db)
                self.db.execute(f"PRAGMA user_version = {version + 1}")

    def is_open(self) -> bool:
        try:
            self.db.execute("SELECT 1")
            return True
        except sqlite3.Error:
            return False

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------ transactions
    @contextmanager
    def tx(self):  # noqa: ANN201
        """One transaction; rolled back on error so the connection never stays inside one.
        Inside an open one (a :meth:`group`) it is a savepoint: rolled back alone, committed
        with the group."""
        if self.in_tx:
            self.db.execute("SAVEPOINT tx")
            try:
                yield
            except BaseException:
                self.db.execute("ROLLBACK TO tx")
                self.db.execute("RELEASE tx")
                raise
            self.db.execute("RELEASE tx")
            return
        self.db.execute("BEGIN")
        self.in_tx = True
        try:
            yield
        except BaseException:
            self.in_tx = False
            self.db.execute("ROLLBACK")
            raise
        self.in_tx = False
        self.commit()

    @contextmanager
    def group(self):  # noqa: ANN201
        """One transaction that keeps what was applied when an error comes part-way: it is
        committed (as if each write had committed alone) and the error propagates. Joins an
        open transaction."""
        if self.in_tx:
            yield
            return
        self.db.execute("BEGIN")
        self.in_tx = True
        try:
            yield
        finally:
            self.in_tx = False
            self.commit()

    def commit(self) -> None:
        """COMMIT; if it fails, the connection is left outside any transaction (SQLite rolls
        back itself on a full disk or an I/O error; anything else is rolled back here)."""
        try:
            self.db.execute("COMMIT")
        except BaseException:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # already rolled back by SQLite
            raise

    # ------------------------------------------------------------------ rows
    def save_sample(self, s: SampleRow) -> None:
        self.db.execute(
            "UPDATE samples SET state=?, attempt=?, notice=?, on_disk_bytes=?, errors=?, qpos=?, lease_token=?, slot=? "
            "WHERE job_id=? AND epoch=? AND idx=?",
            (s.state.value, s.attempt, s.notice_json(), s.on_disk_bytes,
             json.dumps(s.errors) if s.errors else None, s.qpos, s.lease_token,
             s.slot.model_dump_json() if s.slot is not None else None, s.key.job, s.key.epoch, s.key.index),
        )  # fmt: skip

    def save_tokens(self, s: SampleRow) -> None:
        """A sample's token ids and loss mask (regenerate mode changes them)."""
        self.db.execute("UPDATE samples SET token_ids=?, loss_mask=? WHERE job_id=? AND epoch=? AND idx=?",
                        (pack(s.token_ids), pack(s.loss_mask), s.key.job, s.key.epoch, s.key.index))  # fmt: skip

    def load(self, key: P.SampleKey) -> SampleRow | None:
        row = self.db.execute(f"SELECT {COLS} FROM samples WHERE job_id=? AND epoch=? AND idx=?",
                              (key.job, key.epoch, key.index)).fetchone()  # fmt: skip
        return None if row is None else row_to_sample(row)

    def save_job(self, j: Job) -> None:
        self.db.execute(
            "UPDATE jobs SET finished=?, tokens_consumed=?, bytes_consumed=? WHERE job_id=?",
            (j.finished, j.tokens_consumed, j.bytes_consumed, j.job_id),
        )
