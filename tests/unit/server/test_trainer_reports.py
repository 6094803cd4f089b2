"""A trainer's training report (HEARTBEAT ``train``): the wire refuses what is not a bounded,
finite, non-negative number; the delivery thread keeps each connected trainer's latest report,
drops a bad heartbeat (counted, the thread serving on) and forgets a trainer it lost; the
Prometheus gauges show exactly the connected trainers' figures. The real delivery service and
``HiddenStateStream`` on real ZeroMQ sockets (ipc)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import zmq

from connector import protocol as P
from server.delivery import DeliveryService
from server.peers import Peer
from server.ledger import Ledger
from server.metrics import SidecarMetrics
from trainer_client import HiddenStateStream


def _beat(train: object, v: int = P.PROTOCOL_VERSION) -> list[bytes]:
    return [b"HEARTBEAT", json.dumps({"v": v, "alive_s": 2.0, "waited_s": 1.0, "train": train}).encode()]


def test_a_report_of_bounded_finite_numbers_decodes():
    hb = P.decode_msg(_beat({"step": 12, "loss": 2.5, "steps_per_s": 3, "samples_per_s": 24.0}))
    assert isinstance(hb, P.Heartbeat)
    assert hb.train == P.TrainReport(step=12, loss=2.5, steps_per_s=3.0, samples_per_s=24.0)
    assert P.decode_msg(_beat({"step": 0})).train == P.TrainReport(step=0)  # figures are optional
    assert P.decode_msg(_beat(None)).train is None
    again = P.decode_msg(P.encode_msg(P.Heartbeat(train=P.TrainReport(step=3, loss=0.0))))
    assert again.train == P.TrainReport(step=3, loss=0.0)


@pytest.mark.parametrize(
    "train",
    [
        pytest.param({"step": 1, "loss": float("nan")}, id="nan-loss"),
        pytest.param({"step": 1, "loss": float("inf")}, id="inf-loss"),
        pytest.param({"step": 1, "loss": -0.5}, id="negative-loss"),
        pytest.param({"step": 1, "loss": P.REPORT_MAX_LOSS * 10}, id="oversized-loss"),
        pytest.param({"step": -1}, id="negative-step"),
        pytest.param({"step": P.REPORT_MAX_STEP + 1}, id="oversized-step"),
        pytest.param({"step": 1.5}, id="fractional-step"),
        pytest.param({"step": True}, id="boolean-step"),
        pytest.param({"step": "7"}, id="string-step"),
        pytest.param({"step": 1, "loss": "0.3"}, id="string-loss"),
        pytest.param({"step": 1, "steps_per_s": -1.0}, id="negative-rate"),
        pytest.param({"step": 1, "samples_per_s": 1e300}, id="oversized-rate"),
        pytest.param({"step": 1, "extra": "x" * 1000}, id="unknown-field"),
        pytest.param({"loss": 1.0}, id="no-step"),
        pytest.param([1, 2], id="not-an-object"),
        pytest.param("report", id="a-string"),
    ],
)
def test_a_report_out_of_its_bounds_refuses_the_heartbeat(train):
    with pytest.raises(P.ProtocolError, match="invalid Heartbeat"):
        P.decode_msg(_beat(train))


def test_a_non_finite_wait_figure_refuses_the_heartbeat():
    with pytest.raises(P.ProtocolError):
        P.decode_msg([b"HEARTBEAT", f'{{"v": {P.PROTOCOL_VERSION}, "alive_s": Infinity, "waited_s": 1.0}}'.encode()])


def test_report_validates_and_the_next_heartbeat_carries_the_latest():
    s = HiddenStateStream("ipc:///nonexistent/d.sock", spool_dir="/dev/shm")
    assert s._heartbeat().train is None
    s.report(step=1, loss=3.0)
    s.report(step=2, loss=2.0, steps_per_s=4.0, samples_per_s=32.0)
    assert s._heartbeat().train == P.TrainReport(step=2, loss=2.0, steps_per_s=4.0, samples_per_s=32.0)
    for bad in ({"step": 3, "loss": float("nan")}, {"step": -3}, {"step": 3, "steps_per_s": float("inf")}):
        with pytest.raises(ValueError, match="training report refused"):
            s.report(**bad)
    assert s._heartbeat().train.step == 2  # a refused report leaves the last one standing
    s.close()


def _service(tmp_path: Path, **kw) -> DeliveryService:  # noqa: ANN003
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, Ledger(), **kw)
    svc.start()
    return svc


def _until(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    t_end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t_end, "timed out"
        time.sleep(0.02)


def _figures(svc: DeliveryService) -> list[dict | None]:
    """Each connected trainer's report as the overview shows it, all four figures named."""
    return [t.train and t.train.model_dump() for t in svc.trainers()]


def _report(**kw) -> dict:  # noqa: ANN003
    return P.TrainReport(**kw).model_dump()


def _dealer(ep: str) -> zmq.Socket:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(ep)
    return d


def test_the_delivery_thread_keeps_each_trainers_latest_report_and_drops_bad_ones(tmp_path):
    svc = _service(tmp_path, heartbeat_s=0.1)
    bad = _dealer(svc.endpoint)
    try:
        with HiddenStateStream(svc.endpoint, jobs=["none-yet"], follow=True, spool_dir=svc.spool, idle_s=0.05,
                               heartbeat_s=0.05, timeout_s=30) as s:  # fmt: skip
            it = iter(s)
            for step in (1, 2, 3):
                s.report(step=step, loss=1.0 / step, steps_per_s=5.0)
                t_end = time.monotonic() + 0.3
                while time.monotonic() < t_end:
                    assert next(it) is None  # idle: nothing submitted, but it heartbeats
            _until(lambda: _figures(svc) == [_report(step=3, loss=1 / 3, steps_per_s=5.0)])
            # Another peer's heartbeats out of bounds: dropped and counted, the thread serves on.
            bad.send_multipart(P.encode_msg(P.Hello(jobs=["x"])))
            _until(lambda: len(svc.trainers()) == 2)
            for train in ({"step": 1, "loss": float("nan")}, {"step": 1, "loss": -1.0}, {"step": 10**13}):
                bad.send_multipart(_beat(train))
            bad.send_multipart([b"HEARTBEAT", f'{{"v": {P.PROTOCOL_VERSION}, "train": {{"step": 1, "loss": NaN}}}}'.encode()])
            _until(lambda: svc.stats["bad_messages"] == 4)
            assert svc.alive()
            assert sorted(_figures(svc), key=str) == sorted([None, _report(step=3, loss=1 / 3, steps_per_s=5.0)], key=str)
            s.report(step=4, loss=0.2)
            t_end = time.monotonic() + 0.3
            while time.monotonic() < t_end:
                next(it)
            _until(lambda: _report(step=4, loss=0.2) in _figures(svc))
    finally:
        bad.close(linger=0)
        svc.stop()


def test_a_lost_trainer_takes_its_report_and_its_series_with_it(tmp_path):
    svc = _service(tmp_path, peer_timeout_s=0.5)
    metrics = SidecarMetrics(svc.ledger)
    metrics.trainers.source = svc.trainers
    d = _dealer(svc.endpoint)
    try:
        d.send_multipart(P.encode_msg(P.Hello(jobs=["j"])))
        d.send_multipart(P.encode_msg(P.Heartbeat(alive_s=4.0, waited_s=1.0, train=P.TrainReport(step=9, loss=0.7))))
        _until(lambda: _figures(svc) == [_report(step=9, loss=0.7)])
        (tid,) = [t.id for t in svc.trainers()]
        text = metrics.render(svc.spool)[0].decode()
        assert f'hsstream_trainer_loss{{trainer="{tid}"}} 0.7' in text
        assert f'hsstream_trainer_step{{trainer="{tid}"}} 9.0' in text
        assert f'hsstream_trainer_wait_share{{trainer="{tid}"}} 0.25' in text
        d.close(linger=0)  # silent from now on: presumed dead after peer_timeout_s
        _until(lambda: not svc.peers)
        text = metrics.render(svc.spool)[0].decode()
        assert tid not in text and "hsstream_trainers_connected 0.0" in text
    finally:
        svc.stop()


def _info(owner: bytes, train: P.TrainReport | None, beats: tuple = ()):  # noqa: ANN001
    p = Peer(remote=False, greeted=True)
    for alive, waited in beats:
        p.on_heartbeat(alive, waited, train)
    if not beats:
        p.on_heartbeat(0.0, 0.0, train)
    return p.info(owner, 0.0)


def test_gauges_show_each_connected_trainers_figures_and_only_theirs():
    m = SidecarMetrics(Ledger())
    full = _info(b"L\x01", P.TrainReport(step=0, loss=0.0, steps_per_s=2.5, samples_per_s=20.0), ((10, 2), (20, 7)))
    bare = _info(b"L\x02", None)
    m.trainers.source = lambda: [full, bare]
    text = m.render(Path("/dev/shm"))[0].decode()
    lines = {ln for ln in text.splitlines() if ln.startswith("hsstream_trainer")}
    assert lines == {
        "hsstream_trainers_connected 2.0",
        'hsstream_trainer_wait_share{trainer="4c01"} 0.35',
        'hsstream_trainer_wait_share_recent{trainer="4c01"} 0.5',
        'hsstream_trainer_step{trainer="4c01"} 0.0',  # a zero is a figure, not a missing one
        'hsstream_trainer_loss{trainer="4c01"} 0.0',
        'hsstream_trainer_steps_per_second{trainer="4c01"} 2.5',
        'hsstream_trainer_samples_per_second{trainer="4c01"} 20.0',
    }, lines  # the trainer without a report or heartbeat figures has no series at all
    m.trainers.source = lambda: [bare]
    assert "4c01" not in m.render(Path("/dev/shm"))[0].decode()
