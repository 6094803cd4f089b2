"""A sample that becomes READY is offered at once, not at the delivery thread's next poll
timeout: the notices thread rings the delivery thread's doorbell after its commit."""

from __future__ import annotations

import threading
import time

import zmq

from connector import protocol as P
from server import delivery
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample, NoticeOutcome, State
from server.notices import NoticeReceiver


def _deliver_after_ready(tmp_path, monkeypatch, poll_ms: int, wake: bool) -> float:
    """Seconds from a notice applied on another thread (the notices thread's code, rung to the
    delivery thread's doorbell if ``wake``) to its DELIVER at a waiting trainer, with the poll
    timeout set to ``poll_ms`` (long, so only a wake-up can be fast)."""
    monkeypatch.setattr(delivery, "POLL_MS", poll_ms)
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ledger = Ledger()
    job = ledger.add_job([NewSample([1, 2, 3], None, "s0", 30)])
    ep = f"ipc://{tmp_path}/run/d.sock"
    svc = DeliveryService(ep, spool, ledger, heartbeat_s=60)
    rx = NoticeReceiver(f"ipc://{tmp_path}/run/n.sock", spool, ledger,
                        wake_delivery=svc.doorbell.ring if wake else None)  # fmt: skip
    svc.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(ep)
        dealer.send_multipart(P.encode_msg(P.Hello(jobs=[job.job_id])))
        dealer.send_multipart(P.encode_msg(P.Credit(n=4)))
        time.sleep(0.3)  # the thread has seen both and gone back to sleep in its poll
        s = ledger.next_to_submit(10**9)
        (spool / "hs-0.safetensors").write_bytes(b"x" * 30)
        notice = P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt,
                          file="hs-0.safetensors", num_tokens=3, nbytes=30)  # fmt: skip
        t0 = time.monotonic()
        threading.Thread(target=rx.handle_batch, args=([notice.encode()],)).start()  # as the notices thread does
        assert dealer.poll(poll_ms + 5000), "nothing delivered"
        took = time.monotonic() - t0
        msg = P.decode_msg(dealer.recv_multipart())
        assert isinstance(msg, P.Deliver) and msg.notice.key == s.key
        return took
    finally:
        dealer.close(linger=0)
        svc.stop()


def test_a_ready_sample_wakes_the_delivery_thread(tmp_path, monkeypatch):
    assert _deliver_after_ready(tmp_path, monkeypatch, poll_ms=3000, wake=True) < 1.0


def test_without_the_wake_up_it_waits_for_the_poll(tmp_path, monkeypatch):
    """The control: the same set-up without the doorbell waits out the poll timeout, so the
    test above measures the wake-up and not some other message that woke the thread. The poll
    is long (5 s) against the 1 s bound: its timer runs from before the set-up's 0.3 s sleep,
    which a loaded machine stretches."""
    assert _deliver_after_ready(tmp_path, monkeypatch, poll_ms=5000, wake=False) > 1.0


def test_the_doorbell_is_closed_when_the_thread_stops_and_a_late_ring_does_nothing(tmp_path):
    ledger = Ledger()
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", tmp_path, ledger)
    assert not svc.doorbell.is_open
    svc.start()
    assert svc.doorbell.is_open and svc.doorbell.fileno() >= 0
    svc.stop()
    assert not svc.doorbell.is_open and svc.doorbell.fileno() == -1
    svc.doorbell.ring()  # e.g. the notices thread, after the delivery thread ended


def test_a_delivered_notice_says_how_long_it_took_to_the_sidecar_and_through_it(tmp_path):
    """The sidecar's share of the notice-to-trainer latency, in the DELIVER's notice (the
    connector's own timings kept): to its notice socket, then through ledger and delivery."""
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ledger = Ledger()
    job = ledger.add_job([NewSample([1, 2, 3], None, "s0", 30)])
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger, heartbeat_s=60)
    rx = NoticeReceiver(f"ipc://{tmp_path}/run/n.sock", spool, ledger, wake_delivery=svc.doorbell.ring)
    rx.start()
    svc.start()
    ctx = zmq.Context.instance()
    push, dealer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    try:
        dealer.connect(svc.endpoint)
        dealer.send_multipart(P.encode_msg(P.Hello(jobs=[job.job_id])))
        dealer.send_multipart(P.encode_msg(P.Credit(n=4)))
        push.connect(rx.endpoint)
        s = ledger.next_to_submit(10**9)
        (spool / "hs-0.safetensors").write_bytes(b"x" * 30)
        sent = time.time() - 0.25  # as if the connector had sent it a quarter second ago
        t0 = time.time()
        push.send(P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt,
                           file="hs-0.safetensors", num_tokens=3, nbytes=30, sent_at=sent,
                           timings={"write": 0.01}).encode())  # fmt: skip
        assert dealer.poll(5000), "nothing delivered"
        took = time.time() - t0
        msg = P.decode_msg(dealer.recv_multipart())
        t = msg.notice.timings
        assert t["write"] == 0.01  # the connector's, untouched
        assert 0.25 <= t[P.TIMING_SIDECAR_IN] < 0.25 + took
        assert 0 <= t[P.TIMING_SIDECAR_QUEUE] <= took - (t[P.TIMING_SIDECAR_IN] - 0.25)
    finally:
        push.close(linger=0)
        dealer.close(linger=0)
        svc.stop()
        rx.stop()


def test_in_regenerate_mode_vllms_reply_that_makes_a_sample_ready_rings_the_doorbell():
    """The notice came first (the file waits for the reply's token ids); the reply makes the
    sample READY on the submitter's event loop, which rings the delivery thread once."""
    import asyncio

    from server.submitter import Submitter
    from tests.unit.server.fake_vllm_http import FakeHttp, reply
    from tests.unit.server.submitter_runs import run_until

    ledger = Ledger()
    job = ledger.add_job([NewSample([1, 2, 3], [0, 0, 0], None, 30)], sampling={"max_tokens": 2})

    def vllm(req):  # noqa: ANN001, ANN202
        if req.path == "/v1/models":
            return reply(200, {"data": [{"id": "m", "max_model_len": 64}]})
        tag = P.tag_from_kv_params(req.body["kv_transfer_params"])
        held = ledger.on_notice(P.Notice(status=P.NoticeStatus.ok, request_id="r", key=tag.key, attempt=tag.attempt,
                                         file="hs-0.safetensors", num_tokens=4, nbytes=30), 30)  # fmt: skip
        assert held is NoticeOutcome.held  # kept, not READY: the reply is still to come
        return reply(200, {"choices": [{"text": "ab", "token_ids": [7, 8]}]})

    rings = []
    sub = Submitter(ledger, "http://vllm", client=FakeHttp(vllm), budget_bytes=10**9, notice_timeout_s=600,
                    wake_delivery=lambda: rings.append(ledger.job_samples(job.job_id)[0].state))  # fmt: skip
    asyncio.run(run_until(sub, lambda: bool(rings)))
    assert rings == [State.ready] and ledger.job_samples(job.job_id)[0].token_ids == [1, 2, 3, 7]
