"""The sidecar's notice handling: strict decoding, the spool boundary, the ledger's states."""

from __future__ import annotations

import os

import pytest

from connector import protocol as P
from server.ledger import Ledger, NewSample, State
from server.notices import NoticeReceiver


@pytest.fixture
def setup(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    outside = tmp_path / "precious.safetensors"
    outside.write_bytes(b"not yours")
    ledger = Ledger(max_attempts=2)
    job = ledger.add_job([NewSample([1, 2, 3], None, "a", 30)])
    s = ledger.next_to_submit(budget=10**9)
    assert s is not None and s.state == State.submitted
    return spool, outside, ledger, job, NoticeReceiver("inproc://unused", spool, ledger)


def notice(key, file, **kw):
    return P.Notice(status=P.NoticeStatus.ok, request_id="r", key=key, file=file, num_tokens=3, **kw).encode()


@pytest.mark.parametrize("name", ["../precious.safetensors", "/etc/passwd", "sub/x.safetensors", "..safetensors"])
def test_notice_outside_spool_is_refused_and_nothing_touched(setup, name):
    spool, outside, ledger, job, rx = setup
    rx.handle(notice(ledger.job_samples(job.job_id)[0].key, name))
    assert rx.stats["refused"] == 1
    assert outside.read_bytes() == b"not yours"
    # a refused notice does not touch the sample: still waiting for its own notice, no attempt spent
    smp = ledger.job_samples(job.job_id)[0]
    assert smp.state == State.submitted and smp.attempt == 0 and smp.errors == []


def test_a_flood_of_refused_notices_with_a_real_key_costs_no_attempt(setup):
    spool, outside, ledger, job, rx = setup
    key = ledger.job_samples(job.job_id)[0].key
    (spool / "evil.safetensors").mkdir()  # not a regular file, and not a name the connector writes
    (spool / "hs-dir.safetensors").mkdir()
    os.symlink(outside, spool / "hs-link.safetensors")
    bad = ["evil.safetensors", "hs-dir.safetensors", "hs-link.safetensors", "hs-missing.safetensors",
           "model.safetensors", ".hs-x.safetensors.1.tmp"]
    for _ in range(5):  # 30 notices > max_attempts (2)
        for name in bad:
            rx.handle(notice(key, name))
    assert rx.stats["refused"] == 30
    smp = ledger.job_samples(job.job_id)[0]
    assert smp.state == State.submitted and smp.attempt == 0 and smp.errors == []
    (spool / "hs-real.safetensors").write_bytes(b"x" * 30)
    rx.handle(notice(key, "hs-real.safetensors"))  # the sample's own notice still lands
    assert smp.state == State.ready and smp.notice.file == "hs-real.safetensors"
    assert outside.read_bytes() == b"not yours" and (spool / "evil.safetensors").is_dir()


def test_symlink_in_spool_is_refused(setup):
    spool, outside, ledger, job, rx = setup
    os.symlink(outside, spool / "hs-link.safetensors")
    rx.handle(notice(ledger.job_samples(job.job_id)[0].key, "hs-link.safetensors"))
    assert rx.stats["refused"] == 1
    assert outside.read_bytes() == b"not yours"
    assert (spool / "hs-link.safetensors").is_symlink()  # not ours to delete either


def test_good_notice_makes_sample_ready_and_reserves_real_bytes(setup):
    spool, _, ledger, job, rx = setup
    (spool / "hs-f.safetensors").write_bytes(b"x" * 100)
    rx.handle(notice(ledger.job_samples(job.job_id)[0].key, "hs-f.safetensors"))
    assert ledger.job_samples(job.job_id)[0].state == State.ready
    assert ledger.reserved_bytes == 100  # expected bytes released, file bytes held


def test_late_notice_for_old_attempt_is_deleted_not_delivered(setup):
    spool, _, ledger, job, rx = setup
    key = ledger.job_samples(job.job_id)[0].key
    ledger.requeue(key, 0, "vLLM said 500")  # attempt 0 failed, requeued as attempt 1
    (spool / "hs-old.safetensors").write_bytes(b"x")
    rx.handle(notice(key, "hs-old.safetensors", attempt=0))
    assert not (spool / "hs-old.safetensors").exists()
    assert ledger.job_samples(job.job_id)[0].state == State.queued and ledger.job_samples(job.job_id)[0].attempt == 1


def test_error_notice_retries_then_fails(setup):
    spool, _, ledger, job, rx = setup
    key = ledger.job_samples(job.job_id)[0].key
    err = P.Notice(status=P.NoticeStatus.error, reason="aborted", request_id="r", key=key).encode()
    rx.handle(err)
    assert ledger.job_samples(job.job_id)[0].state == State.queued and ledger.job_samples(job.job_id)[0].attempt == 1
    assert ledger.next_to_submit(10**9).key == key
    rx.handle(P.Notice(status=P.NoticeStatus.error, reason="aborted", request_id="r", key=key, attempt=1).encode())
    assert ledger.job_samples(job.job_id)[0].state == State.failed and job.done


@pytest.mark.parametrize("raw", [b"not json", b'{"v": 99, "status": "ok", "request_id": "r"}', b"[]"])
def test_malformed_notice_is_refused(setup, raw):
    _, _, ledger, job, rx = setup
    rx.handle(raw)
    assert rx.stats["refused"] == 1 and ledger.job_samples(job.job_id)[0].state == State.submitted


def test_ack_is_exactly_once(setup):
    spool, _, ledger, job, rx = setup
    (spool / "hs-f.safetensors").write_bytes(b"x" * 10)
    rx.handle(notice(ledger.job_samples(job.job_id)[0].key, "hs-f.safetensors"))
    s = ledger.lease_next(b"t1", None)
    assert s is ledger.job_samples(job.job_id)[0]  # the live object
    assert not ledger.ack(b"t2", s.key, s.lease_token)  # another trainer's ack does nothing
    assert not ledger.ack(b"t1", s.key, "0" * 32)  # nor one without the lease's token
    assert ledger.ack(b"t1", s.key, s.lease_token)
    assert not ledger.ack(b"t1", s.key, s.lease_token)  # a repeat changes nothing
    assert job.counts()["consumed"] == 1 and job.tokens_consumed == 3 and ledger.reserved_bytes == 0


def test_notices_that_arrive_together_are_one_commit_and_refused_files_go_after_it(tmp_path):
    from tests.unit.server.test_ledger import _CountingDb

    spool = tmp_path / "spool"
    spool.mkdir()
    ledger = Ledger(tmp_path / "l.sqlite")
    job = ledger.add_job([NewSample([1, 2, 3], None, f"s{i}", 30) for i in range(4)])
    for _ in range(4):
        ledger.next_to_submit(budget=10**9)
    keys = [s.key for s in ledger.job_samples(job.job_id)]
    raws = []
    for i, k in enumerate(keys):
        (spool / f"hs-{i}.safetensors").write_bytes(b"x" * 30)
        raws.append(notice(k, f"hs-{i}.safetensors", attempt=0))
    (spool / "hs-late.safetensors").write_bytes(b"x" * 30)
    raws.append(notice(keys[0], "hs-late.safetensors", attempt=7))  # an attempt that was never made
    ledger._db = counting = _CountingDb(ledger._db)
    rx = NoticeReceiver("inproc://unused", spool, ledger)
    rx.handle_batch(raws)
    assert counting.commits == 1 and rx.stats["notices"] == 5 and rx.stats["deleted"] == 1
    assert [ledger.get(k).state for k in keys] == [State.ready] * 4
    assert sorted(os.listdir(spool)) == [f"hs-{i}.safetensors" for i in range(4)]
