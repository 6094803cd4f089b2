"""A file never outlives its sample when a trainer's messages reach a restarted sidecar late.

What `make test` once saw (test_process_killed_mid_job_and_restarted[sidecar], 3 files left):
the trainer keeps reading, deleting and acking what it holds while the sidecar is down, and
its RECEIVED and ACK wait in its socket until it reconnects. The restarted sidecar recovered
those samples as QUEUED (their files were gone) and may already have produced them again
(attempt 1, READY) by then. Replayed here with the real ledger (on SQLite, restarted), notice
receiver and delivery service, and real files in a spool; only the sockets are left out.
"""

from __future__ import annotations

from connector import protocol as P
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample, State
from server.notices import NoticeReceiver
from server.spool import SpoolKeeper

from tests.support import sample_files

OLD, NEW = b"Lold-identity", b"Lnew-identity"  # the ROUTER gives a reconnected trainer a new one


def _write(spool, s):  # noqa: ANN001, ANN202
    """The connector's part: a file for this attempt, then its notice."""
    name = f"hs-{s.key.index}-attempt{s.attempt}.safetensors"
    return sample_files.write_sample(spool, name, tokens=3, key=s.key, attempt=s.attempt).notice.encode()


def _sidecar(tmp_path, spool):  # noqa: ANN001, ANN202
    """A sidecar's services on the ledger file, started as server/app.py's lifespan does."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    keeper = SpoolKeeper(spool, ledger)
    ledger.recover(keeper.exists)
    keeper.sweep(min_age_s=0)
    return ledger, NoticeReceiver("inproc://unused", spool, ledger), DeliveryService(
        f"ipc://{tmp_path}/d.sock", spool, ledger)  # fmt: skip


def _from_trainer(delivery, owner, *msgs) -> None:  # noqa: ANN001
    delivery._on_messages(owner[:1], [[owner[1:], *P.encode_msg(m)] for m in msgs])


def _leased_then_restarted(tmp_path, spool):  # noqa: ANN001, ANN202
    """One sample delivered to a trainer that reads it (deleting its file) while the sidecar is
    down; the restarted sidecar produces it again before the trainer's messages come."""
    P.claim_spool(spool)
    ledger, notices, _ = _sidecar(tmp_path, spool)
    job = ledger.add_job([NewSample([1, 2, 3], None, "a", 30)])
    notices.handle(_write(spool, ledger.next_to_submit(10**9)))
    (s,) = ledger.lease_many(OLD, None, 1)
    token = s.lease_token  # its DELIVER carried it: the trainer's late messages name it
    ledger.close()  # SIGKILL: nothing more is written
    P.remove_from_spool(spool, s.notice.file)  # the trainer read it; its RECEIVED and ACK wait in its socket
    ledger, notices, delivery = _sidecar(tmp_path, spool)
    s = ledger.get(s.key)
    assert s.state == State.queued and s.attempt == 1  # recovered: the file is gone, produce it again
    s = ledger.next_to_submit(10**9)  # the live sample from here on (QUEUED ones are SQLite rows)
    notices.handle(_write(spool, s))
    assert s.state == State.ready and len(list(spool.glob("hs-*"))) == 1
    return ledger, notices, delivery, ledger.jobs[job.job_id], s, token


def test_a_late_received_for_the_old_file_keeps_the_new_one(tmp_path):
    spool = tmp_path / "spool"
    ledger, notices, delivery, job, s, token = _leased_then_restarted(tmp_path, spool)
    _from_trainer(delivery, NEW, P.Received(keys=[s.key], tokens=[token]))  # about the file it deleted, not this one
    assert s.state == State.ready and spool.joinpath(s.notice.file).exists()  # still good: not produced again
    _from_trainer(delivery, NEW, P.Ack(keys=[s.key], tokens=[token]))
    if (again := ledger.next_to_submit(10**9)) is not None:  # (before the fix: produced a third time)
        notices.handle(_write(spool, again))
    assert job.counts()["consumed"] == 1
    assert sorted(p.name for p in spool.glob("hs-*")) == []  # nothing left for the reaper


def test_an_ack_for_a_sample_produced_again_removes_its_new_file(tmp_path):
    spool = tmp_path / "spool"
    ledger, notices, delivery, job, s, token = _leased_then_restarted(tmp_path, spool)
    _from_trainer(delivery, NEW, P.Ack(keys=[s.key], tokens=[token]))  # its RECEIVED was lost with the old sidecar
    assert job.counts()["consumed"] == 1 and ledger.reserved_bytes == 0
    assert sorted(p.name for p in spool.glob("hs-*")) == []  # the new copy nobody will read is gone


def test_the_reaper_says_at_warning_which_file_it_found_unowned_and_how_old(tmp_path, caplog):
    """Left to the reaper is a leak unless a notice was lost: it must show in a WARNING+ log
    (the one `make test` keeps), not only as a full spool. The start-up sweep stays quiet."""
    import logging
    import os
    import time

    spool = tmp_path / "spool"
    P.claim_spool(spool)
    keeper = SpoolKeeper(spool, Ledger(), grace_s=60)
    old = spool / "hs-stray.safetensors"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 90, time.time() - 90))
    with caplog.at_level(logging.WARNING, logger="hsstream.sidecar"):
        assert keeper.sweep() == 1
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING and "hs-stray.safetensors, 90 s old" in rec.getMessage()
    caplog.clear()
    (spool / "hs-after-a-crash.safetensors").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="hsstream.sidecar"):
        assert keeper.sweep(min_age_s=0) == 1
    assert caplog.records == []
