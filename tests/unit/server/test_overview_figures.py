"""The figures ``hsstream top`` shows that are computed, not counted: consumption rates over a
window, and a trainer's wait share from its heartbeats."""

from __future__ import annotations

from server.peers import Peer
from server.metrics import RateMeter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rates_count_the_last_full_window_and_forget_older_seconds():
    clock = Clock()
    m = RateMeter(window_s=10, clock=clock)
    for _ in range(20):  # 20 samples of 50 tokens over 5 s
        m.add(1, 50)
        clock.t += 0.25
    assert clock.t == 1005.0
    assert m.rates() == (2.0, 100.0)  # 20 samples / 10 s window
    clock.t = 1014.0  # seconds 1000..1003 have left the window, 1004 (4 samples) is still in it
    assert m.rates() == (0.4, 20.0)
    clock.t = 1020.0
    assert m.rates() == (0.0, 0.0)
    m.add(1, 7)  # the current second counts once it is over
    assert m.rates() == (0.0, 0.0)
    clock.t = 1021.0
    assert m.rates() == (0.1, 0.7)
    assert len(m._buckets) <= 11  # memory bounded by the window, not by the rate


def test_wait_share_from_heartbeats_overall_and_between_the_last_two():
    p = Peer(remote=False)
    assert p.info(b"L\x01", 0.0).wait_share is None
    p.on_heartbeat(0.0, 0.0)  # not iterating yet: no figure
    assert p.info(b"L\x01", 0.0).wait_share is None
    p.on_heartbeat(10.0, 2.0)
    i = p.info(b"L\x01", 0.0)
    assert i.wait_share == 0.2 and i.wait_share_recent is None and i.alive_s == 10.0
    p.on_heartbeat(12.0, 3.5)  # waited 1.5 of the last 2 s: starved now
    i = p.info(b"L\x01", 0.0)
    assert i.wait_share == round(3.5 / 12, 4) and i.wait_share_recent == 0.75
    p.on_heartbeat(12.0, 3.5)  # a repeated beat (keepalive) keeps the last interval
    assert p.info(b"L\x01", 0.0).wait_share_recent == 0.75
