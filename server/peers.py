"""One trainer as the delivery thread sees it (``Peer``): what it asked for, its credit, what it
holds against its share of the spool budget, its heartbeats' figures and its latest training
report, and how ``/v1/stats`` and ``/v1/overview`` show it (``info``). Owned by the delivery
thread (``delivery.py``); the REST layer reads only the ``TrainerInfo`` snapshots it makes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from connector import protocol as P
from connector.contract.rest import TrainerInfo, TrainFigures


@dataclass
class Peer:
    remote: bool
    transport: str = "spool"
    jobs: list[str] | None = None
    follow: bool = False
    credit: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    last_sent: float = field(default_factory=time.monotonic)
    #: When it first spoke: the order trainers are shown in (the dict's order is the serving line).
    joined: float = field(default_factory=time.monotonic)
    ended: bool = False
    greeted: bool = False
    delivered: int = 0
    acked: int = 0
    #: Keys delivered to it and not yet RECEIVED, FAILed or handed back (nor ACKed, unless the
    #: ACK left the sample's slot with it for its views), with their spool bytes: what it holds.
    #: Its credit is only a claim; this is what the server counts against ``max_credit`` and
    #: against its share of the spool budget.
    holding: dict[P.SampleKey, int] = field(default_factory=dict)
    held_bytes: int = 0
    #: Its share of the spool budget at the last delivery pass (None: no share rule).
    share_bytes: int | None = None
    #: It sent an ACK or RECEIVED over the limit of keys: said once in the log, then only counted.
    warned_oversized: bool = False
    #: A DELIVER to it was refused (its queue full, it does not read): no new leases until then.
    stalled_until: float = 0.0
    #: Refused (another protocol version, a HELLO over the limits): told once, served nothing.
    refused: bool = False
    #: It settled a sample without its lease token: said once in the log, then only counted.
    warned_unheld: bool = False
    #: The stream's own figures from its heartbeats: (alive_s, waited_s) now and one beat before.
    beat: tuple[float, float] | None = None
    prev_beat: tuple[float, float] | None = None
    #: Its loop's latest training report (from its heartbeats; None until it gives one). Held
    #: only while it is a peer: it goes with the peer when the trainer is presumed dead.
    train: P.TrainReport | None = None

    def hold(self, key: P.SampleKey, nbytes: int) -> None:
        self.held_bytes += nbytes - self.holding.get(key, 0)
        self.holding[key] = nbytes

    def let_go(self, keys) -> None:  # noqa: ANN001 - any iterable of keys
        for k in keys:
            self.held_bytes -= self.holding.pop(k, 0)

    def let_go_all(self) -> None:
        self.holding.clear()
        self.held_bytes = 0

    def on_heartbeat(self, alive_s: float, waited_s: float, train: P.TrainReport | None = None) -> None:
        if train is not None:
            self.train = train  # a beat without one keeps the last (a loop that reports rarely)
        if alive_s <= 0:
            return  # one that has not started iterating
        if self.beat is not None and alive_s > self.beat[0]:
            self.prev_beat = self.beat
        self.beat = (alive_s, waited_s)

    def info(self, owner: bytes, now: float) -> TrainerInfo:
        share = recent = None
        if self.beat is not None:
            share = self.beat[1] / self.beat[0]
            if self.prev_beat is not None:
                recent = (self.beat[1] - self.prev_beat[1]) / (self.beat[0] - self.prev_beat[0])
        return TrainerInfo(
            id=owner.hex(), remote=self.remote, jobs=self.jobs, credit=self.credit, delivered=self.delivered,
            acked=self.acked, last_seen_s=round(now - self.last_seen, 3),
            alive_s=self.beat[0] if self.beat else None,
            wait_share=None if share is None else round(min(max(share, 0.0), 1.0), 4),
            wait_share_recent=None if recent is None else round(min(max(recent, 0.0), 1.0), 4),
            train=None if self.train is None else TrainFigures(**self.train.model_dump()),
            holding=len(self.holding), holding_bytes=self.held_bytes, share_bytes=self.share_bytes,
        )  # fmt: skip
