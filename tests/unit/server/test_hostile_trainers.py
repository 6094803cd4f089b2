"""A trainer that asks for everything and reads nothing, beside an honest one: the real delivery
service, a real ledger and real ZeroMQ sockets (ipc). The stuck peer is a raw DEALER that says
HELLO (transport zmq), CREDIT 10^9 and heartbeats, with the smallest receive queue ZeroMQ and
the kernel allow, so the sidecar's queue to it fills; the honest one reads, receives, acks and
gives credit back as a stream does."""

from __future__ import annotations

import os
import threading
import time

import zmq

from connector import protocol as P
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample, State

FILE_BYTES = 16 * 1024  # each DELIVER to the zmq peer carries this much: the kernel's buffer fills at once


def _produce(ledger: Ledger, spool, job_size: int, rate_per_s: float, stop: threading.Event) -> None:
    """One job whose samples become READY over time, each with a file (its bytes are not
    checked here: neither peer validates)."""
    job = ledger.jobs[next(iter(ledger.jobs))]
    assert job.num_samples == job_size
    t0 = time.monotonic()
    for i in range(job_size):
        if stop.is_set():
            return
        while time.monotonic() - t0 < i / rate_per_s:
            time.sleep(0.002)
        s = ledger.next_to_submit(10**12)
        name = f"hs-{s.key.index}.safetensors"
        (spool / name).write_bytes(b"\0" * FILE_BYTES)
        n = P.Notice(status=P.NoticeStatus.ok, request_id=name, key=s.key, attempt=s.attempt, file=name,
                     num_tokens=3, nbytes=FILE_BYTES)  # fmt: skip
        ledger.on_notice(n, FILE_BYTES)


def _stuck_peer(ep: str) -> zmq.Socket:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.RCVHWM, 1)
    d.setsockopt(zmq.RCVBUF, 4096)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(ep)
    d.send_multipart(P.encode_msg(P.Hello(jobs=None, same_host=False, transport="zmq")))
    d.send_multipart(P.encode_msg(P.Credit(n=10**9)))
    return d


def _run(tmp_path, *, seconds: float, **svc_kw) -> tuple[list[float], int, Ledger, DeliveryService, str]:
    """The stuck peer and the honest one for ``seconds``: the honest one's message times (DELIVER
    or HEARTBEAT), how many samples it consumed, and the ledger and service afterwards."""
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ledger = Ledger()
    job_size = 2400
    job = ledger.add_job([NewSample([1, 2, 3], None, None, FILE_BYTES) for _ in range(job_size)]).job_id
    ep = f"ipc://{tmp_path}/run/d.sock"
    svc = DeliveryService(ep, spool, ledger, peer_timeout_s=2.0, heartbeat_s=0.5, **svc_kw)
    svc.start()
    stop = threading.Event()
    stuck = honest = vanishing = None
    try:
        stuck = _stuck_peer(ep)
        time.sleep(0.2)  # the stuck peer is known first: an old sidecar served it first on every pass
        producer = threading.Thread(target=_produce, args=(ledger, spool, job_size, 800.0, stop), daemon=True)
        producer.start()
        # A third trainer takes a few samples and goes silent: its timeout still fires on time.
        vanishing = zmq.Context.instance().socket(zmq.DEALER)
        vanishing.setsockopt(zmq.LINGER, 0)
        vanishing.connect(ep)
        vanishing.send_multipart(P.encode_msg(P.Hello(jobs=[job])))
        vanishing.send_multipart(P.encode_msg(P.Credit(n=4)))
        honest = zmq.Context.instance().socket(zmq.DEALER)
        honest.setsockopt(zmq.LINGER, 0)
        honest.connect(ep)
        honest.send_multipart(P.encode_msg(P.Hello(jobs=[job])))
        honest.send_multipart(P.encode_msg(P.Credit(n=8)))
        heard, consumed = [time.monotonic()], 0
        t_end = time.monotonic() + seconds
        last_beat = time.monotonic()
        while time.monotonic() < t_end:
            if time.monotonic() - last_beat > 0.5:  # both peers heartbeat: neither is ever "lost"
                stuck.send_multipart(P.encode_msg(P.Heartbeat(window=10**9)), zmq.NOBLOCK)
                honest.send_multipart(P.encode_msg(P.Heartbeat(window=8)))
                last_beat = time.monotonic()
            if not honest.poll(50):
                continue
            msg = P.decode_msg(honest.recv_multipart())
            heard.append(time.monotonic())
            if isinstance(msg, P.Deliver):
                P.remove_from_spool(spool, msg.notice.file)
                held = {"keys": [msg.notice.key], "tokens": [msg.token]}
                honest.send_multipart(P.encode_msg(P.Received(**held)))
                honest.send_multipart(P.encode_msg(P.Ack(**held)))
                honest.send_multipart(P.encode_msg(P.Credit(n=1)))
                consumed += 1
        heard.append(time.monotonic())
        return heard, consumed, ledger, svc, job
    finally:
        stop.set()
        for sock in (stuck, honest, vanishing):
            if sock is not None:
                sock.close(linger=0)
        svc.stop()


def _gaps(heard: list[float]) -> float:
    return max(b - a for a, b in zip(heard, heard[1:], strict=False))


def test_a_peer_that_never_reads_cannot_take_the_samples_or_stall_the_others(tmp_path):
    heard, consumed, ledger, svc, job = _run(tmp_path, seconds=5.0, max_credit=16)
    assert _gaps(heard) < 2.0, f"the honest trainer heard nothing for {_gaps(heard):.1f} s"
    assert consumed > 200, f"the honest trainer got only {consumed} samples"  # of ~4,000 offered; the gaps are the stall check
    assert svc.stats["peers_lost"] == 1, "the trainer that went silent was never timed out"
    held = sum(1 for s in ledger.job_samples(job) if s.state == State.leased)
    assert held <= 16 + 8, f"{held} samples leased: the stuck peer holds more than its capped credit"


def test_a_full_queue_hands_the_lease_back_at_once(tmp_path):
    """Credit no cap would stop (the cap above the queue's room): the sends the full queue
    refuses give their leases back, so the honest trainer gets those samples."""
    heard, consumed, ledger, svc, job = _run(tmp_path, seconds=5.0, max_credit=100_000, send_hwm=4)
    assert _gaps(heard) < 2.0, f"the honest trainer heard nothing for {_gaps(heard):.1f} s"
    assert consumed > 200, f"the honest trainer got only {consumed} samples"  # of ~4,000 offered; the gaps are the stall check
    samples = ledger.job_samples(job)
    held = sum(1 for s in samples if s.state == State.leased)
    assert held < 64, f"{held} samples leased to a peer that reads nothing"
    assert svc.stats["send_refused"] > 0
    assert sum(1 for s in samples if s.state != State.queued) >= consumed + held  # none lost on the way
    assert os.path.isdir(tmp_path / "spool")
