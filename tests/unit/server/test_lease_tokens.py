"""Only the holder settles a sample: an ACK, RECEIVED or FAIL counts only with the lease token
its DELIVER carried. Keys are sequential and job ids come back from REST, so a peer that was
never delivered a sample can name it; it cannot name its token. The real delivery service, a
real ledger and real ZeroMQ sockets (ipc); the hostile peer is a raw DEALER."""

from __future__ import annotations

import time

import zmq

from connector import protocol as P
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample
from server.metrics import SidecarMetrics


def _ready_job(ledger: Ledger, spool, n: int) -> str:
    job = ledger.add_job([NewSample([1, 2, 3], None, None, 30) for _ in range(n)]).job_id
    for _ in range(n):
        s = ledger.next_to_submit(10**9)
        name = f"hs-{s.key.index}.safetensors"
        (spool / name).write_bytes(b"x" * 30)
        ledger.on_notice(P.Notice(status=P.NoticeStatus.ok, request_id=name, key=s.key, attempt=s.attempt,
                                  file=name, num_tokens=3, nbytes=30), 30)  # fmt: skip
    return job


def _dealer(ep: str) -> zmq.Socket:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(ep)
    return d


def _until(cond, timeout: float = 5.0) -> bool:  # noqa: ANN001
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_settling_keys_never_delivered_changes_nothing_and_is_counted(tmp_path):
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ledger = Ledger()
    job = _ready_job(ledger, spool, 5)
    metrics = SidecarMetrics(ledger)
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger,
                          on_unheld=metrics.count_unheld)  # as server/app.py wires it  # fmt: skip
    svc.start()
    hostile = _dealer(svc.endpoint)
    try:
        keys = [P.SampleKey(job=job, index=i) for i in range(5)]
        guessed = ["0" * 32, "f" * 32, "", "x", "0123456789abcdef0123456789abcdef"]
        hostile.send_multipart(P.encode_msg(P.Received(keys=keys, tokens=guessed)))
        hostile.send_multipart(P.encode_msg(P.Received(keys=keys)))
        for k, t in zip(keys, guessed, strict=True):
            hostile.send_multipart(P.encode_msg(P.Fail(key=k, reason="bad", token=t)))
        hostile.send_multipart(P.encode_msg(P.Ack(keys=keys, tokens=guessed)))
        hostile.send_multipart(P.encode_msg(P.Ack(keys=keys)))  # no token at all
        assert _until(lambda: svc.stats["unheld_acks"] == 10)
        assert svc.stats["unheld_receiveds"] == 10 and svc.stats["unheld_fails"] == 5
        text = metrics.render(spool)[0].decode()
        assert 'hsstream_unheld_settlements_total{kind="acks"} 10.0' in text
        assert 'hsstream_unheld_settlements_total{kind="fails"} 5.0' in text
        counts = ledger.jobs[job].counts()
        assert counts["ready"] == 5 and counts["consumed"] == 0, counts
        assert not ledger.jobs[job].done
        assert all(s.attempt == 0 and not s.errors for s in ledger.job_samples(job))
        assert len(list(spool.glob("hs-*"))) == 5 and ledger.reserved_bytes == 150
        # An honest trainer still gets all five, and its settling counts.
        honest = _dealer(svc.endpoint)
        honest.send_multipart(P.encode_msg(P.Hello(jobs=[job])))
        honest.send_multipart(P.encode_msg(P.Credit(n=5)))
        got = []
        while len(got) < 5:
            assert honest.poll(5000)
            msg = P.decode_msg(honest.recv_multipart())
            if isinstance(msg, P.Deliver):
                got.append(msg)
        assert len({d.token for d in got}) == 5 and all(len(d.token) == 32 for d in got)
        # The hostile peer, now that the samples are leased, still cannot settle them.
        hostile.send_multipart(P.encode_msg(P.Ack(keys=keys, tokens=guessed)))
        assert _until(lambda: svc.stats["unheld_acks"] == 15)
        assert ledger.jobs[job].counts()["leased"] == 5
        for d in got:
            P.remove_from_spool(spool, d.notice.file)
        honest.send_multipart(P.encode_msg(P.Received(keys=[d.notice.key for d in got], tokens=[d.token for d in got])))
        honest.send_multipart(P.encode_msg(P.Ack(keys=[d.notice.key for d in got], tokens=[d.token for d in got])))
        assert _until(lambda: ledger.jobs[job].counts()["consumed"] == 5)
        assert ledger.reserved_bytes == 0 and svc.stats["unheld_acks"] == 15
        honest.close(linger=0)
    finally:
        hostile.close(linger=0)
        svc.stop()


def test_the_stream_echoes_each_deliverys_token_in_its_acks_receipts_and_fails(tmp_path):
    """Deferred acks (``ack="manual"``, as the Eagle-3 trainer acks after a checkpoint) name the
    latest lease of each key: a redelivery while the sample is held unacked replaces the token."""
    from tests.unit.trainer_client.test_stream_pool import FakeSidecar, write_sample
    from trainer_client import HiddenStateStream

    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ds = [write_sample(spool, i, bad="nan" if i == 2 else None) for i in range(4)]
    (spool / ds[3].notice.file).unlink()  # not received: FAIL with not_received
    again = write_sample(spool, 0)  # key 0 redelivered (its lease lapsed): a new copy, a new lease
    (spool / ds[0].notice.file).rename(spool / "hs-0-first.safetensors")
    ds[0] = ds[0].model_copy(update={"notice": ds[0].notice.model_copy(update={"file": "hs-0-first.safetensors"})})
    tokens = [f"{i:032x}" for i in range(4)]
    ds = [d.model_copy(update={"token": t}) for d, t in zip(ds, tokens, strict=True)]
    ds.append(again.model_copy(update={"token": "a" * 32}))
    sc = FakeSidecar(tmp_path, ds)
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=spool, credit=8, timeout_s=20, workers=0, ack="manual") as s:
            got = [x.key for x in s]
            s.ack_through(got[-1])
        time.sleep(0.3)
    finally:
        sc.stop()
    assert [k.index for k in got] == [0, 1]
    fails = {f.key.index: f for f in sc.of(P.Fail)}
    assert fails[2].token == tokens[2] and not fails[2].not_received
    assert fails[3].token == tokens[3] and fails[3].not_received
    received = {(k.index, t) for m in sc.of(P.Received) for k, t in m.pairs()}
    assert received == {(0, tokens[0]), (1, tokens[1]), (0, "a" * 32)}
    acks = [(k.index, t) for m in sc.of(P.Ack) for k, t in m.pairs()]
    assert acks == [(0, "a" * 32), (1, tokens[1])]  # key 0 with its latest lease's token


def test_a_checkpoints_many_acks_go_in_messages_of_bounded_size(tmp_path, monkeypatch):
    from tests.unit.trainer_client.test_stream_pool import FakeSidecar, write_sample
    from trainer_client import HiddenStateStream
    from trainer_client import stream as S

    monkeypatch.setattr(S, "ACK_KEYS", 3)
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ds = [write_sample(spool, i).model_copy(update={"token": f"{i:032x}"}) for i in range(7)]
    sc = FakeSidecar(tmp_path, ds)
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=spool, credit=8, timeout_s=20, workers=0, ack="manual") as s:
            got = [x.key for x in s]
            s.ack_all_used()
        time.sleep(0.3)
    finally:
        sc.stop()
    assert [len(m.keys) for m in sc.of(P.Ack)] == [3, 3, 1]
    assert sorted((k.index, t) for m in sc.of(P.Ack) for k, t in m.pairs()) == [(i, f"{i:032x}") for i in range(7)]
    assert len(got) == 7


def test_an_honest_stream_settles_everything_through_the_real_sidecar_with_deferred_acks(tmp_path):
    """The real delivery service and ledger, the real stream (``ack="manual"``, acks after the
    loop as after a checkpoint): every sample consumed, no settlement ignored."""
    from tests.unit.trainer_client.test_stream_pool import write_sample
    from trainer_client import HiddenStateStream

    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ds = [write_sample(spool, i) for i in range(6)]
    ledger = Ledger()
    job = ledger.add_job([NewSample(d.expected_token_ids, None, None, 30) for d in ds]).job_id
    for d in ds:
        s = ledger.next_to_submit(10**12)
        src = ds[s.key.index].notice
        ledger.on_notice(src.model_copy(update={"key": s.key, "attempt": s.attempt}), (spool / src.file).stat().st_size)
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger)
    svc.start()
    try:
        with HiddenStateStream(svc.endpoint, jobs=[job], spool_dir=spool, credit=4, timeout_s=20, ack="manual") as st:
            got = []
            for x in st:
                got.append(x.key)
                if len(got) == 6:
                    st.ack_through(got[-1])
        assert _until(lambda: ledger.jobs[job].counts()["consumed"] == 6), ledger.jobs[job].counts()
    finally:
        svc.stop()
    assert sorted(k.index for k in got) == list(range(6))
    assert svc.stats["unheld_acks"] == svc.stats["unheld_receiveds"] == svc.stats["unheld_fails"] == 0
    assert ledger.reserved_bytes == 0 and not list(spool.glob("hs-*"))
