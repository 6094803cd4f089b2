"""The ledger file's schema version: a file written by an older release opens and is upgraded,
a file of a newer release is refused (real SQLite files)."""

from __future__ import annotations

import json
import sqlite3
from array import array

import pytest

from connector import protocol as P
from server.ledger import SCHEMA_VERSION, Ledger, State

# The CREATE statements of the release before the schema had a version (user_version 0),
# verbatim: what every ledger file written until then holds.
_UNVERSIONED = """
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, created REAL, finished REAL, tokens_consumed INTEGER DEFAULT 0,
  bytes_consumed INTEGER DEFAULT 0, meta TEXT, summary TEXT);
CREATE TABLE IF NOT EXISTS samples (
  job_id TEXT, epoch INTEGER, idx INTEGER, ord INTEGER, token_ids BLOB, loss_mask BLOB, label TEXT,
  expected_bytes INTEGER, state TEXT, attempt INTEGER, notice TEXT, on_disk_bytes INTEGER, errors TEXT,
  prompt_len INTEGER, qpos INTEGER, PRIMARY KEY (job_id, epoch, idx));
CREATE INDEX IF NOT EXISTS samples_queue ON samples(qpos) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS samples_in_flight ON samples(job_id, ord) WHERE state IN ('submitted', 'ready', 'leased');
CREATE INDEX IF NOT EXISTS samples_errors ON samples(job_id, ord) WHERE errors IS NOT NULL;
"""


def _old_ledger(path, job: str = "j0") -> None:
    """A ledger as the unversioned release left it: one job, a sample leased, one ready, one queued."""
    db = sqlite3.connect(path)
    db.executescript(_UNVERSIONED)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("INSERT INTO jobs (job_id, created, meta) VALUES (?, ?, ?)", (job, 1.0, json.dumps({"sampling": None})))
    ids = array("i", [1, 2, 3]).tobytes()
    for i, state in enumerate(("leased", "ready", "queued")):
        key = P.SampleKey(job=job, index=i)
        notice = None if state == "queued" else P.Notice(status=P.NoticeStatus.ok, request_id=f"r{i}", key=key,
                                                          file=f"hs-{i}.safetensors", num_tokens=3, nbytes=30)
        db.execute("INSERT INTO samples VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (job, 0, i, i, ids, None, None, 30, state, 0, notice.model_dump_json() if notice else None,
                    0 if notice is None else 30, None, 3, i))  # fmt: skip
    db.commit()
    db.close()


def test_a_ledger_of_the_unversioned_release_is_upgraded_and_keeps_its_samples(tmp_path):
    path = tmp_path / "ledger.sqlite"
    _old_ledger(path)
    led = Ledger(path)
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert "lease_token" in {r[1] for r in led._db.execute("PRAGMA table_info(samples)")}
    assert led.recover(lambda f: True) == {"ready": 2}  # the old lease cannot be trusted: READY again
    assert led.jobs["j0"].counts()["ready"] == 2 and led.jobs["j0"].counts()["queued"] == 1
    old_lease = led.get(P.SampleKey(job="j0", index=0))
    assert old_lease.lease_token is None
    assert not led.ack(b"t", old_lease.key, "")  # leased before tokens: no one can settle that lease
    s = led.lease_next(b"t", None)
    assert s.lease_token and led.ack(b"t", s.key, s.lease_token)
    led.close()
    # Opened again (already upgraded): nothing to do, the token of a lease is still there.
    led2 = Ledger(path)
    led2.recover(lambda f: True)
    assert led2._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert led2.get(s.key).state == State.consumed
    t = led2.lease_next(b"t", None)
    led2.close()
    led3 = Ledger(path)
    led3.recover(lambda f: True)
    assert led3.ack(b"t2", t.key, t.lease_token)  # settled after a restart with the token on disk


def test_a_new_ledger_gets_todays_schema_and_version(tmp_path):
    led = Ledger(tmp_path / "new.sqlite")
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    cols = {r[1] for r in led._db.execute("PRAGMA table_info(samples)")}
    assert {"qpos", "lease_token"} <= cols


def test_a_ledger_of_a_newer_release_is_refused(tmp_path):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match=rf"schema version {SCHEMA_VERSION + 1}, newer"):
        Ledger(path)
