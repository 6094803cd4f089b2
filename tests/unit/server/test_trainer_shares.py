"""No trainer pins what the others need (issue 40, item 4): what a trainer holds — delivered and
not RECEIVED, or (arena) acked with its slot still viewed — counts against its share of the spool
budget. The real delivery service, ledger and ZeroMQ sockets (ipc), samples produced within the
budget as the submitter does, on both spool layouts.

Once, with an 8 MiB budget, a peer that took 15 samples and never said RECEIVED left an honest
trainer 0 of 48 in 20 s."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from connector import protocol as P
from connector.contract import arena as A
from server.arena import SlotAllocator
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample

SAMPLE = A.PAGE  # a sample's spool bytes (a page: an arena slot's least)
BUDGET = 16 * SAMPLE


class Sidecar:
    """A ledger, its producer (within the budget) and the delivery service, on one layout."""

    def __init__(self, tmp_path, layout: str, pace_s: float = 0.0) -> None:  # noqa: ANN001
        self.spool = tmp_path / "spool"
        P.claim_spool(self.spool)
        self.ledger = Ledger()
        if layout == "arena":
            self.ledger.attach_slots(SlotAllocator("ab" * 16, BUDGET + A.PAGE, quarantine_s=0.0))
        self.layout = layout
        self.pace_s = pace_s  # > 0: one sample at a time, as a busy engine hands them over
        self.job = self.ledger.add_job([NewSample([1, 2, 3], None, None, SAMPLE) for _ in range(400)]).job_id
        self.ep = f"ipc://{tmp_path}/run/d.sock"
        self.svc = DeliveryService(self.ep, self.spool, self.ledger, peer_timeout_s=30.0, heartbeat_s=0.5,
                                   budget_bytes=BUDGET)  # fmt: skip
        self.stop = threading.Event()
        self.producer = threading.Thread(target=self._produce, daemon=True)

    def _produce(self) -> None:
        while not self.stop.is_set():
            s = self.ledger.next_to_submit(BUDGET)
            if s is None:
                time.sleep(0.002)
                continue
            if self.layout == "arena":
                n = P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt, slot=s.slot,
                             num_tokens=3, nbytes=SAMPLE)  # fmt: skip
                self.ledger.on_notice(n, s.slot.length)
            else:
                name = f"hs-{s.key.index}.safetensors"
                (self.spool / name).write_bytes(b"\0" * SAMPLE)
                n = P.Notice(status=P.NoticeStatus.ok, request_id=name, key=s.key, attempt=s.attempt, file=name,
                             num_tokens=3, nbytes=SAMPLE)  # fmt: skip
                self.ledger.on_notice(n, SAMPLE)
            self.svc.doorbell.ring()
            if self.pace_s:
                time.sleep(self.pace_s)

    def __enter__(self) -> Sidecar:
        self.svc.start()
        self.producer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.producer.join(5)
        self.svc.stop()


class Trainer(threading.Thread):
    """A raw DEALER: HELLO, ``credit``, then on each DELIVER what ``settle`` says, heartbeating."""

    def __init__(self, ep: str, job: str, credit: int, settle: str) -> None:
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(ep)
        self.sock.send_multipart(P.encode_msg(P.Hello(jobs=[job])))
        self.sock.send_multipart(P.encode_msg(P.Credit(n=credit)))
        self.settle = settle  # "all": RECEIVED + ACK + CREDIT; "none": keeps it; "ack": ACK, no RECEIVED (views kept)
        self.got: list[P.SampleKey] = []
        self.done = threading.Event()

    def run(self) -> None:
        last_beat = 0.0
        while not self.done.is_set():
            if time.monotonic() - last_beat > 0.3:
                self.sock.send_multipart(P.encode_msg(P.Heartbeat()))
                last_beat = time.monotonic()
            if not self.sock.poll(50):
                continue
            msg = P.decode_msg(self.sock.recv_multipart())
            if not isinstance(msg, P.Deliver):
                continue
            key = msg.notice.key
            self.got.append(key)
            if self.settle == "all":
                self.sock.send_multipart(P.encode_msg(P.Received(keys=[key], tokens=[msg.token])))
            if self.settle in ("all", "ack"):
                self.sock.send_multipart(P.encode_msg(P.Ack(keys=[key], tokens=[msg.token])))
            if self.settle == "all":
                self.sock.send_multipart(P.encode_msg(P.Credit(n=1)))

    def close(self) -> None:
        self.done.set()
        self.join(5)
        self.sock.close()


def _wait(cond, timeout: float) -> bool:  # noqa: ANN001
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize(("layout", "greedy"), [("files", "none"), ("arena", "none"), ("arena", "ack")])
def test_a_trainer_that_never_lets_go_does_not_starve_the_others(tmp_path, layout, greedy):
    """The greedy one comes first and alone: it may hold the whole budget but one sample's room
    (and no more once another trainer comes: half of it then). The honest one, joining later,
    is served 48 samples all the same."""
    with Sidecar(tmp_path, layout) as sc:
        pig = Trainer(sc.ep, sc.job, credit=1000, settle=greedy)
        pig.start()
        honest = None
        try:
            assert _wait(lambda: len(pig.got) >= BUDGET // SAMPLE - 1, 20), len(pig.got)
            time.sleep(0.5)  # all it will get alone
            alone = len(pig.got)
            honest = Trainer(sc.ep, sc.job, credit=4, settle="all")
            honest.start()
            assert _wait(lambda: len(honest.got) >= 48, 20), f"honest got {len(honest.got)} of 48"
            assert alone == len(pig.got) == BUDGET // SAMPLE - 1  # the whole budget but a sample; then nothing new
            shown = max(sc.svc.trainers(), key=lambda t: t.holding)  # what /v1/stats and /v1/overview show
            assert shown.holding == BUDGET // SAMPLE - 1 and shown.holding_bytes == (BUDGET // SAMPLE - 1) * SAMPLE
            assert shown.share_bytes == BUDGET // 2 and sc.svc.stats["share_limited"] > 0
        finally:
            pig.close()
            if honest is not None:
                honest.close()


@pytest.mark.parametrize("pace_s", [0.0, 0.004])
def test_two_honest_trainers_share_the_stream(tmp_path, pace_s):
    """Trainers that let go as they should are both served all along, in turn: neither waits on
    a share, and samples produced one at a time do not all go to the trainer that spoke first
    (once 360 of 400 against an equal peer's 40, when the delivery pass always began with it)."""
    with Sidecar(tmp_path, "files", pace_s=pace_s) as sc:
        a, b = Trainer(sc.ep, sc.job, credit=8, settle="all"), Trainer(sc.ep, sc.job, credit=8, settle="all")
        a.start()
        b.start()
        try:
            assert _wait(lambda: len(a.got) + len(b.got) >= 400, 30), (len(a.got), len(b.got))
            assert min(len(a.got), len(b.got)) >= 400 * 0.3, (len(a.got), len(b.got))
        finally:
            a.close()
            b.close()
