"""What one peer may send: a message of another protocol version is refused with a reason the
peer can read, a HELLO over the job limit is refused with a reason the stream raises, and a
message over the size limit never reaches the parser (ZeroMQ drops its connection). The real
delivery service and notice receiver on real ZeroMQ sockets (ipc)."""

from __future__ import annotations

import json
import logging
import time

import pytest
import zmq

from connector import protocol as P
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample
from server.notices import NoticeReceiver
from trainer_client import HiddenStateStream, StreamError


def _service(tmp_path, **kw) -> DeliveryService:  # noqa: ANN003
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, Ledger(), **kw)
    svc.start()
    return svc


def _dealer(ep: str) -> zmq.Socket:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(ep)
    return d


def test_a_trainer_of_the_previous_protocol_version_is_told_the_versions_and_served_nothing(tmp_path, monkeypatch):
    svc = _service(tmp_path)
    old = _dealer(svc.endpoint)
    try:
        # The previous release's trainer: its messages are valid messages of the version before.
        prev = P.PROTOCOL_VERSION - 1
        old.send_multipart([b"HELLO", json.dumps({"v": prev, "jobs": None}).encode()])
        old.send_multipart([b"CREDIT", json.dumps({"v": prev, "n": 8}).encode()])
        old.send_multipart([b"HEARTBEAT", json.dumps({"v": prev, "alive_s": 1.0, "waited_s": 0.5}).encode()])
        assert old.poll(5000)
        frames = old.recv_multipart()
        end = P.decode_msg(frames)
        assert isinstance(end, P.End) and f"version {prev} " in end.reason
        assert f"speaks protocol version {P.PROTOCOL_VERSION}" in end.reason
        assert not old.poll(500)  # said once, nothing else (no heartbeats, no samples)
        # What the old stream raises on reading it: its own decoder refuses this version, by name.
        from connector.contract import messages

        cur = P.PROTOCOL_VERSION
        monkeypatch.setattr(messages, "PROTOCOL_VERSION", prev)
        with pytest.raises(P.VersionMismatch, match=rf"version {cur} \(this build speaks {prev}\)"):
            P.decode_msg(frames)
    finally:
        old.close(linger=0)
        svc.stop()


def test_a_notice_of_the_previous_protocol_version_is_refused_with_both_versions_in_the_log(tmp_path, caplog):
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ledger = Ledger()
    ledger.add_job([NewSample([1, 2, 3], None, None, 30)])
    s = ledger.next_to_submit(10**9)
    rx = NoticeReceiver("inproc://unused", spool, ledger)
    old = json.loads(P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key).encode())
    old["v"] = P.PROTOCOL_VERSION - 1
    with caplog.at_level(logging.ERROR, logger="hsstream.sidecar"):
        rx.handle(json.dumps(old).encode())
    assert rx.stats["refused"] == 1
    assert f"unsupported protocol version {old['v']} (this build speaks {P.PROTOCOL_VERSION})" in caplog.text


def test_a_hello_over_the_job_limit_is_refused_and_the_stream_says_why(tmp_path):
    svc = _service(tmp_path, max_hello_jobs=3)
    try:
        with pytest.raises(StreamError, match=r"HELLO names 4 jobs; .*at most 3 .*HSSTREAM_MAX_HELLO_JOBS"):
            with HiddenStateStream(svc.endpoint, jobs=["a", "b", "c", "d"], spool_dir=svc.spool, timeout_s=10) as s:
                list(s)
        ok = _dealer(svc.endpoint)
        ok.send_multipart(P.encode_msg(P.Hello(jobs=["a", "b", "c"])))  # within the limit: greeted
        t_end = time.monotonic() + 5
        while not any(p.greeted for p in svc.peers.values()) and time.monotonic() < t_end:
            time.sleep(0.02)
        ok.close(linger=0)
        assert [p.jobs for p in svc.peers.values() if p.greeted] == [["a", "b", "c"]]
    finally:
        svc.stop()


def test_a_message_over_the_size_limit_never_reaches_the_sidecar(tmp_path):
    svc = _service(tmp_path, max_message_bytes=64 << 10)
    big = _dealer(svc.endpoint)
    try:
        assert svc._socks[b"L"].getsockopt(zmq.MAXMSGSIZE) == 64 << 10
        jobs = [f"{i:064d}" for i in range(2000)]  # 134 kB of job ids
        big.send_multipart(P.encode_msg(P.Hello(jobs=jobs)))
        time.sleep(0.5)
        assert not svc.peers  # dropped by ZeroMQ, unparsed
        big.send_multipart(P.encode_msg(P.Hello(jobs=jobs[:10])))  # it reconnects; a small one is heard
        t_end = time.monotonic() + 5
        while not svc.peers and time.monotonic() < t_end:
            time.sleep(0.02)
        assert [len(p.jobs) for p in svc.peers.values()] == [10]
    finally:
        big.close(linger=0)
        svc.stop()


def test_a_notice_over_the_size_limit_is_dropped_unparsed(tmp_path):
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    rx = NoticeReceiver(f"ipc://{tmp_path}/run/n.sock", spool, Ledger(), max_message_bytes=64 << 10)
    rx.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(rx.endpoint)
    try:
        huge = P.Notice(status=P.NoticeStatus.error, request_id="r", reason="x" * (100 << 10))
        push.send(huge.encode())
        time.sleep(0.5)
        assert rx.stats["notices"] == 0
        push.send(P.Notice(status=P.NoticeStatus.error, request_id="r", reason="small").encode())
        t_end = time.monotonic() + 5
        while rx.stats["notices"] == 0 and time.monotonic() < t_end:
            time.sleep(0.02)
        assert rx.stats["notices"] == 1
    finally:
        push.close(linger=0)
        rx.stop()
