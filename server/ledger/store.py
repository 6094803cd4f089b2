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
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from connector import protocol as P
from connector import layouts as L
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
  prompt_len INTEGER, qpos INTEGER, lease_token TEXT, placement TEXT, PRIMARY KEY (job_id, epoch, idx));
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
        "errors, prompt_len, qpos, lease_token, placement")  # fmt: skip


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


def _to_v5(db: sqlite3.Connection) -> None:
    """The slot column becomes an opaque placement (issue 42): what the sample's spool layout
    reserved, as ``<layout>:<its text>`` (``connector.layouts.encode_placement``), which the ledger
    stores without reading. The slots of before are the arena's, so they keep their JSON under
    that layout's name."""
    db.execute("ALTER TABLE samples RENAME COLUMN slot TO placement")
    db.execute("UPDATE samples SET placement = 'arena:' || placement WHERE placement IS NOT NULL")


#: ``_MIGRATIONS[v]`` brings a file of schema version ``v`` (``PRAGMA user_version``) to ``v + 1``.
#: Append only: a released step never changes, since files it already upgraded exist.
_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_to_v1, _to_v2, _to_v3, _to_v4, _to_v5)
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
    jid, ep, idx, ids, mask, label, eb, st, att, notice, odb, errs, plen, qpos, token, placement = row
    s = SampleRow(P.SampleKey(job=jid, epoch=ep, index=idx), unpack(ids) or [], unpack(mask), label, eb, State(st),
                  att, P.Notice.model_validate_json(notice) if notice else None, odb or 0, lease_token=token,
                  errors=json.loads(errs) if errs else [], prompt_len=plen if plen is not None else -1,
                  qpos=qpos or 0, saved=State(st), slot=L.decode_placement(placement) if placement else None)  # fmt: skip
    s.generated = s.prompt_len >= 0 and len(s.token_ids) > s.prompt_len
    return s


def is_disk_error(e: BaseException) -> bool:
    """A write the volume refused (full, or an I/O error): not the write's fault, worth retrying."""
    if not isinstance(e, sqlite3.OperationalError):
        return False
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)
    text = str(e)
    return "disk is full" in text or "disk I/O error" in text


class LedgerUnsaved(sqlite3.OperationalError):
    """The volume refused the ledger's writes: they wait in memory (``Store.unsaved``) and the
    sidecar is degraded until they are written (``/readyz`` says so)."""


#: A write's journal entry: (what it writes, e.g. ("sample", job, epoch, idx); SQL; parameters).
Write = tuple[tuple, str, tuple]


class Store:
    """The connection and its transactions. Not thread-safe by itself: the ledger's lock is held
    around every use.

    **When the volume cannot write** (full, I/O errors) the ledger's state in memory goes on (the
    threads have told their peers, or will), and the rows it could not write wait in
    :attr:`unsaved`, the latest write of each row in the order written; the ledger is *degraded*
    until :meth:`flush` has written them all in one transaction. Only writes that say a row's
    whole state (:meth:`save_sample`, :meth:`save_tokens`, :meth:`save_job`, :meth:`clear_slot`)
    wait there, so writing them late, in order, gives the state memory has:

    - a :meth:`group` whose writes fail, or whose commit fails, is rolled back and its writes
      wait (the callers keep what the group would have made irreversible: files, offers, slots);
    - a :meth:`tx` is all or nothing: its failure raises and its caller undoes its moves in
      memory (a lease is sent only once on disk); a tx begun while degraded first flushes, and
      fails if that does;
    - a write outside a transaction waits while degraded (so an older unsaved write of its row
      cannot land after it), or when it fails.

    ``on_saved``: called after each commit that left nothing unsaved (the ledger frees the slots
    it held back meanwhile)."""

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
        self._levels: list[list[Write]] = []  # the open transaction's writes, per savepoint
        self._strict = 0  # inside tx(): a failed write raises
        self._journal_only = False  # a group whose writes failed: the rest of it waits too
        #: Rows a failed write or commit left unwritten: their latest write, in the order written.
        self.unsaved: OrderedDict[tuple, tuple[str, tuple]] = OrderedDict()
        self.unsaved_since: float | None = None  # time.time() of the first failure not yet flushed
        self.last_error: str | None = None
        self.on_saved: Callable[[], None] | None = None
        self._migrate()
        self.db.executescript(_INDEXES)

    @property
    def degraded(self) -> bool:
        """Rows wait for the volume (:attr:`unsaved`): memory is ahead of the database."""
        return bool(self.unsaved)

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
        Inside a :meth:`group` it is a savepoint: rolled back alone, committed with the group.
        All or nothing: a failed write or commit raises (see the class)."""
        if self.in_tx or self._levels:
            yield from self._nested()
            return
        if self.unsaved and not self.flush():
            raise LedgerUnsaved(f"the ledger cannot write ({self.last_error}): nothing new is written until the "
                                f"{len(self.unsaved)} row(s) waiting are")  # fmt: skip
        self.db.execute("BEGIN")
        self.in_tx = True
        self._levels.append([])
        self._strict += 1
        try:
            yield
        except BaseException:
            self._end_tx()
            self._rollback()
            raise
        self._end_tx()
        self.commit()
        self._saved()

    def _nested(self):  # noqa: ANN202
        """A tx inside a group: a savepoint while the group writes, else a level of its writes
        only (the group's writes wait: they are the tx's to drop if it fails)."""
        sp = self.in_tx and not self._journal_only
        if sp:
            self.db.execute("SAVEPOINT tx")
        self._levels.append([])
        self._strict += 1
        try:
            yield
        except BaseException as e:
            self._strict -= 1
            self._levels.pop()
            if sp:
                try:
                    self.db.execute("ROLLBACK TO tx")
                    self.db.execute("RELEASE tx")
                except sqlite3.Error:
                    self._journal_only = True  # SQLite rolled the whole group back: its writes wait
            if isinstance(e, sqlite3.Error) and is_disk_error(e):
                self._journal_only = True
                self.last_error = str(e)
            raise
        self._strict -= 1
        if sp:
            self.db.execute("RELEASE tx")
        done = self._levels.pop()
        self._levels[-1].extend(done)

    def _end_tx(self) -> list[Write]:
        self.in_tx = False
        self._strict -= 1
        return self._levels.pop()

    def _rollback(self) -> None:
        try:
            self.db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # SQLite rolled back itself (a full disk, an I/O error), or no transaction was open

    @contextmanager
    def group(self):  # noqa: ANN201
        """One transaction that keeps what was applied when an error comes part-way: it is
        committed (as if each write had committed alone) and the error propagates. Joins an
        open transaction. When the volume refuses its writes or its commit (or was refusing
        already), they wait (:attr:`unsaved`, see the class) and :class:`LedgerUnsaved` is raised
        once the group is done, so the caller keeps what the group would make irreversible."""
        if self.in_tx or self._levels:
            yield
            return
        degraded = bool(self.unsaved) and not self.flush()
        if not degraded:
            self.db.execute("BEGIN")
            self.in_tx = True
        self._journal_only = degraded
        self._levels.append([])
        try:
            yield
        finally:
            self.in_tx = False
            writes = self._levels.pop()
            waits, self._journal_only = self._journal_only, False
            if waits:
                if not degraded:
                    self._rollback()  # none of it half-committed: it all waits, in order
                self._wait(writes, self.last_error)
            else:
                try:
                    self.commit()
                except sqlite3.Error as e:
                    self._wait(writes, str(e))  # memory has these moves: written once the volume takes them
                    raise LedgerUnsaved(f"the ledger's commit failed ({e}): {len(self.unsaved)} row(s) wait") from e
                self._saved()
        if waits:
            raise LedgerUnsaved(f"the ledger cannot write ({self.last_error}): {len(self.unsaved)} row(s) wait")

    def commit(self) -> None:
        """COMMIT; if it fails, the connection is left outside any transaction (SQLite rolls
        back itself on a full disk or an I/O error; anything else is rolled back here)."""
        try:
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

    def flush(self) -> bool:
        """Write what waits (:attr:`unsaved`) in one transaction; True when nothing waits now."""
        if not self.unsaved:
            return True
        if self.in_tx or self._levels:
            return False
        try:
            self.db.execute("BEGIN")
            try:
                for sql, params in self.unsaved.values():
                    self.db.execute(sql, params)
            except BaseException:
                self._rollback()
                raise
            self.commit()
        except sqlite3.Error as e:
            if not is_disk_error(e):
                raise
            self.last_error = str(e)
            return False
        self.unsaved.clear()
        self.unsaved_since = None
        self._saved()
        return True

    def _saved(self) -> None:
        if not self.unsaved and self.on_saved is not None:
            self.on_saved()

    def _wait(self, writes: list[Write], error: str | None) -> None:
        for key, sql, params in writes:
            self.unsaved[key] = (sql, params)
            self.unsaved.move_to_end(key)
        if self.unsaved and self.unsaved_since is None:
            self.unsaved_since = time.time()
        self.last_error = error or self.last_error

    def _write(self, key: tuple, sql: str, params: tuple) -> None:
        """One row's whole state written (see the class for when it waits instead)."""
        w = (key, sql, params)
        if self._journal_only and self._levels:  # a group that waits: its writes wait with it, in order
            self._levels[-1].append(w)
            return
        if not self._levels and self.unsaved:  # outside a transaction while others wait: after them
            self._wait([w], self.last_error)
            return
        try:
            self.db.execute(sql, params)
        except sqlite3.Error as e:
            if self._strict or not is_disk_error(e):
                raise
            self.last_error = str(e)
            if self._levels:  # the rest of the group waits with it (SQLite may have rolled it back)
                self._journal_only = True
                self._levels[-1].append(w)
            else:
                self._wait([w], str(e))
            return
        if self._levels:
            self._levels[-1].append(w)

    # ------------------------------------------------------------------ rows
    def save_sample(self, s: SampleRow) -> None:
        self._write(
            ("sample", s.key.job, s.key.epoch, s.key.index),
            "UPDATE samples SET state=?, attempt=?, notice=?, on_disk_bytes=?, errors=?, qpos=?, lease_token=?, placement=?, "
            "expected_bytes=? WHERE job_id=? AND epoch=? AND idx=?",
            (s.state.value, s.attempt, s.notice_json(), s.on_disk_bytes,
             json.dumps(s.errors) if s.errors else None, s.qpos, s.lease_token,
             L.encode_placement(s.slot) if s.slot is not None else None, s.expected_bytes,
             s.key.job, s.key.epoch, s.key.index),
        )  # fmt: skip

    def save_tokens(self, s: SampleRow) -> None:
        """A sample's token ids and loss mask (regenerate mode changes them)."""
        self._write(("tokens", s.key.job, s.key.epoch, s.key.index),
                    "UPDATE samples SET token_ids=?, loss_mask=? WHERE job_id=? AND epoch=? AND idx=?",
                    (pack(s.token_ids), pack(s.loss_mask), s.key.job, s.key.epoch, s.key.index))  # fmt: skip

    def clear_slot(self, key: P.SampleKey) -> None:
        """A finished sample's placement (a slot) is given back: its row no longer names it."""
        self._write(("placement", key.job, key.epoch, key.index),
                    "UPDATE samples SET placement=NULL WHERE job_id=? AND epoch=? AND idx=?",
                    (key.job, key.epoch, key.index))  # fmt: skip

    def load(self, key: P.SampleKey) -> SampleRow | None:
        row = self.db.execute(f"SELECT {COLS} FROM samples WHERE job_id=? AND epoch=? AND idx=?",
                              (key.job, key.epoch, key.index)).fetchone()  # fmt: skip
        return None if row is None else row_to_sample(row)

    def load_many(self, keys: list[P.SampleKey]) -> dict[P.SampleKey, SampleRow]:
        """The rows of ``keys`` that exist, in one query."""
        cols = ", ".join(f"s.{c.strip()}" for c in COLS.split(","))
        out: dict[P.SampleKey, SampleRow] = {}
        for row in self.db.execute(f"SELECT {cols} {_JOIN_KEYS}", (_keys_json(keys),)):
            s = row_to_sample(row)
            out[s.key] = s
        return out

    def lease_tokens(self, keys: list[P.SampleKey]) -> dict[tuple[str, int, int], str | None]:
        """Each existing key's latest lease token, by (job, epoch, index), in one query (no token
        ids read)."""
        return {(jid, ep, idx): token for jid, ep, idx, token in
                self.db.execute(f"SELECT s.job_id, s.epoch, s.idx, s.lease_token {_JOIN_KEYS}", (_keys_json(keys),))}  # fmt: skip

    def save_job(self, j: Job) -> None:
        self._write(("job", j.job_id), "UPDATE jobs SET finished=?, tokens_consumed=?, bytes_consumed=? WHERE job_id=?",
                    (j.finished, j.tokens_consumed, j.bytes_consumed, j.job_id))  # fmt: skip


#: Rows of the keys a JSON array of [job, epoch, index] names, each found by the primary key
#: (a row-value ``IN`` list would scan the table).
_JOIN_KEYS = ("FROM json_each(?) AS k JOIN samples AS s ON s.job_id = json_extract(k.value, '$[0]') "
              "AND s.epoch = json_extract(k.value, '$[1]') AND s.idx = json_extract(k.value, '$[2]')")


def _keys_json(keys: list[P.SampleKey]) -> str:
    return json.dumps([[k.job, k.epoch, k.index] for k in keys], separators=(",", ":"))
