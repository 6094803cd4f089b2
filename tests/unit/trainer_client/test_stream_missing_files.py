"""A delivered file that is gone or unreadable in our own spool is our race, not a bad sample
and not a wrong ``spool_dir``: the stream reports it not received (FAIL with ``not_received``,
no attempt spent), the sidecar produces it again, and the loop goes on. Only a wrong spool (the
directory or its marker missing) stops the stream. The reaper keeps a file whose notice is
still on its way, however old."""

from __future__ import annotations

import os
import time

import pytest

from connector import protocol as P
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample, NoticeOutcome, State
from server.spool import SpoolKeeper
from tests.unit.trainer_client.test_stream_pool import FakeSidecar, write_sample
from trainer_client import HiddenStateStream, StreamError
from trainer_client import sample_reader as S


@pytest.fixture
def marked(tmp_path):
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    return spool


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["missing", "unreadable"])
def test_a_missing_or_unreadable_file_is_reported_not_received_and_the_loop_goes_on(tmp_path, marked, workers, how,
                                                                                   monkeypatch):
    ds = [write_sample(marked, i) for i in range(3)]
    victim = marked / ds[1].notice.file
    if how == "missing":
        victim.unlink()
    else:  # EACCES (or EIO) on open; root reads a mode-000 file, so the open itself refuses
        real = S.safe_open

        def refusing(path, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if os.path.basename(path) == victim.name:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *a, **kw)

        monkeypatch.setattr(S, "safe_open", refusing)
    sc = FakeSidecar(tmp_path, ds)
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=marked, credit=4, timeout_s=20, workers=workers) as s:
            got = [x.key.index for x in s]
        time.sleep(0.3)
    finally:
        sc.stop()
    assert sorted(got) == [0, 2]
    (fail,) = sc.of(P.Fail)
    assert fail.key == ds[1].notice.key and fail.not_received
    assert s.stats["not_received"] == 1 and s.stats["invalid"] == 0
    assert sorted(k.index for k in sc.keys(P.Ack)) == [0, 2]


@pytest.mark.parametrize("wrong", ["unmarked", "absent"])
def test_a_wrong_spool_still_stops_the_stream_and_reports_nothing(tmp_path, marked, wrong):
    ds = [write_sample(marked, i) for i in range(2)]
    elsewhere = tmp_path / "elsewhere"
    if wrong == "unmarked":
        elsewhere.mkdir()
    sc = FakeSidecar(tmp_path, ds)
    try:
        with pytest.raises(StreamError, match=r"cannot read delivered file .* in spool_dir .*elsewhere"):
            with HiddenStateStream(sc.endpoint, spool_dir=elsewhere, credit=4, timeout_s=20, workers=0) as s:
                list(s)
        time.sleep(0.3)
    finally:
        sc.stop()
    assert not sc.of(P.Fail) and not sc.of(P.Received) and not sc.of(P.Ack)


def test_a_spool_whose_every_file_is_missing_stops_the_stream(tmp_path, marked):
    """A marked spool that is not the sidecar's (another stack's): every delivery would be
    produced again forever, no attempt spent; the stream stops after a run of them."""
    ds = [write_sample(marked, i) for i in range(40)]
    for d in ds:
        (marked / d.notice.file).unlink()
    sc = FakeSidecar(tmp_path, ds)
    try:
        with pytest.raises(StreamError, match=r"in a row .*spool_dir"):
            with HiddenStateStream(sc.endpoint, spool_dir=marked, credit=4, timeout_s=20, workers=0) as s:
                list(s)
    finally:
        sc.stop()
    assert 0 < len(sc.of(P.Fail)) < 40


def test_fail_not_received_is_optional_on_the_wire():
    key = P.SampleKey(job="j", index=3)
    frames = P.encode_msg(P.Fail(key=key, reason="bad"))
    assert b"not_received" not in frames[1]  # a plain FAIL is what an older sidecar parses
    plain = P.decode_msg([b"FAIL", b'{"v": %d, "key": {"job": "j", "index": 3, "epoch": 0}, "reason": "x"}' % P.PROTOCOL_VERSION])
    assert isinstance(plain, P.Fail) and not plain.not_received
    again = P.decode_msg(P.encode_msg(P.Fail(key=key, reason="gone", not_received=True)))
    assert again.not_received and again.key == key


def _leased(led: Ledger, n: int = 1):
    led.add_job([NewSample([1, 2, 3], None, None, 100) for _ in range(n)])
    out = []
    for i in range(n):
        s = led.next_to_submit(10**9)
        n_ = P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt,
                      file=f"hs-{i}.safetensors", num_tokens=3, nbytes=100)  # fmt: skip
        assert led.on_notice(n_, 120) is NoticeOutcome.ready
        out.append((s, n_))
    for _ in range(n):
        led.lease_next(b"t", None)
    return out


def test_the_ledger_produces_a_not_received_sample_again_without_spending_an_attempt():
    led = Ledger(max_attempts=1)
    ((s, old),) = _leased(led)
    for round_ in range(3):  # more than max_attempts: none is spent
        token = led.get(s.key).lease_token
        assert led.trainer_failed(b"t", s.key, token, "file missing", not_received=True) == old.file
        smp = led.get(s.key)
        assert smp.state == State.queued and not smp.errors and led.reserved_bytes == 0
        again = led.next_to_submit(10**9)
        assert again.key == s.key and again.attempt == round_ + 1
        n = old.model_copy(update={"attempt": again.attempt})
        assert led.on_notice(old, 120) is NoticeOutcome.refused  # a late notice of an older attempt is refused
        assert led.on_notice(n, 120) is NoticeOutcome.ready
        led.lease_next(b"t", None)
    assert led.jobs[s.key.job].n_errors == 0 and led.jobs[s.key.job].counts()["failed"] == 0
    token = led.get(s.key).lease_token
    assert led.trainer_failed(b"t", s.key, token, "checksum mismatch") is not None  # a real FAIL still counts
    assert led.get(s.key).state == State.failed


def test_the_delivery_service_passes_not_received_to_the_ledger(tmp_path, marked):
    led = Ledger(max_attempts=1)
    ((s, _),) = _leased(led)
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", marked, led)
    fail = P.Fail(key=s.key, reason="file missing", not_received=True, token=led.get(s.key).lease_token)
    svc._on_message(b"t", P.encode_msg(fail))
    smp = led.get(s.key)
    assert smp.state == State.queued and not smp.errors


def _aged(path, seconds):
    os.utime(path, (time.time() - seconds, time.time() - seconds))


def test_the_reaper_keeps_an_old_file_whose_notice_has_not_arrived(tmp_path, marked):
    """Written and renamed, its notice still on the way (a busy sidecar, a notice thread
    restarting): the file is the SUBMITTED sample's, whatever its age."""
    from connector.spool_writer import ShapeInfo, SpoolWriter, WriteJob
    import torch

    led = Ledger()
    led.add_job([NewSample([1, 2, 3], None, None, 100)])
    s = led.next_to_submit(10**9)
    w = SpoolWriter(marked, None, ShapeInfo([1], 2, 4, "bfloat16", "m"), num_threads=1)
    w.submit(WriteJob("r", "hs-r.safetensors", P.RequestTag(key=s.key, attempt=s.attempt), [1, 2, 3],
                      torch.zeros((3, 1, 4), dtype=torch.bfloat16)))  # fmt: skip
    assert w.flush(5)
    w.close()
    (marked / "hs-junk.safetensors").write_bytes(b"not a safetensors file")
    for name in ("hs-r.safetensors", "hs-junk.safetensors"):
        _aged(marked / name, 600)
    keeper = SpoolKeeper(marked, led, grace_s=60)
    assert keeper.sweep() == 1  # the junk only
    assert (marked / "hs-r.safetensors").exists() and not (marked / "hs-junk.safetensors").exists()
    led.requeue(s.key, s.attempt, "notice timeout")  # the sample moved on: the file is nobody's
    assert keeper.sweep() == 1 and not (marked / "hs-r.safetensors").exists()
