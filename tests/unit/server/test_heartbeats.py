"""Heartbeats both ways between the real delivery service and the real stream (ipc sockets)."""

from __future__ import annotations

import time

import zmq

from connector import protocol as P
from server.delivery import DeliveryService
from server.ledger import Ledger
from trainer_client import HiddenStateStream


def test_the_sidecar_heartbeats_an_idle_trainer(tmp_path):
    ep = f"ipc://{tmp_path}/run/d.sock"
    svc = DeliveryService(ep, tmp_path, Ledger(), heartbeat_s=0.2)
    svc.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(ep)
        dealer.send_multipart(P.encode_msg(P.Hello(jobs=["nothing-yet"])))  # no credit, nothing to deliver
        t0 = time.monotonic()
        assert dealer.poll(3000), "no heartbeat from the sidecar"
        assert isinstance(P.decode_msg(dealer.recv_multipart()), P.Heartbeat)
        assert time.monotonic() - t0 < 2.0
    finally:
        dealer.close(linger=0)
        svc.stop()


def test_a_trainer_reconnects_to_a_sidecar_that_fell_silent(tmp_path):
    """A sidecar that accepted the connection and then says nothing (hung, or its connection
    state lost): the stream drops the connection and greets again on a fresh one."""
    import threading

    ep = f"ipc://{tmp_path}/d.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(ep)
    stream = HiddenStateStream(ep, jobs=["j"], spool_dir=tmp_path, timeout_s=20, heartbeat_s=0.2, sidecar_silence_s=1.0)
    out: list = []
    t = threading.Thread(target=lambda: out.extend(stream))
    t.start()
    try:
        hellos: dict[bytes, float] = {}
        t0 = time.monotonic()
        while len(hellos) < 2 and time.monotonic() - t0 < 10:
            if router.poll(200):
                ident, *frames = router.recv_multipart()
                if isinstance(P.decode_msg(frames), P.Hello):
                    hellos[ident] = time.monotonic()
        assert len(hellos) == 2, "the stream did not reconnect to a silent sidecar"
        a, b = sorted(hellos.values())
        assert 0.8 < b - a < 5.0
        router.send_multipart([max(hellos, key=hellos.get), *P.encode_msg(P.End(jobs=["j"]))])
        t.join(10)
        assert not t.is_alive() and out == [] and stream.stats["reconnects"] >= 1
    finally:
        stream.close()
        router.close(linger=0)
