"""The sidecar's delivery endpoint: a ROUTER owned by one thread, trainers are DEALERs.

Credit-based flow control (ZeroMQ Guide, ch. 7): a trainer says how many samples it can
hold and never gets more. Every message from a trainer counts as a heartbeat; a trainer
silent for longer than ``peer_timeout_s`` is presumed dead and its leases go back (READY if
the file is still there, else QUEUED to be produced again), so nothing is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from connector import protocol as P
from server.ledger import Ledger
from server.notices import prepare_ipc

log = logging.getLogger("hsstream.sidecar")


@dataclass
class Peer:
    jobs: list[str] | None = None
    follow: bool = False
    credit: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    ended: bool = False
    greeted: bool = False


class DeliveryService:
    def __init__(self, endpoint: str, spool: Path, ledger: Ledger, peer_timeout_s: float = 30.0) -> None:
        self.endpoint = endpoint
        self.spool = spool
        self.ledger = ledger
        self.peer_timeout_s = peer_timeout_s
        self.peers: dict[bytes, Peer] = {}
        self.stats = {"delivered": 0, "acked": 0, "duplicate_acks": 0, "trainer_failed": 0, "peers_lost": 0}
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hsstream-delivery", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._bound.wait(10)
        if self._error:
            raise self._error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _file_exists(self, name: str | None) -> bool:
        try:
            return name is not None and P.resolve_in_spool(self.spool, name).exists()
        except (P.UnsafePathError, FileNotFoundError):
            return False

    def _run(self) -> None:
        try:
            prepare_ipc(self.endpoint)
            sock = zmq.Context.instance().socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.bind(self.endpoint)
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._bound.set()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(20):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(frames[0], frames[1:])
                self._dispatch(sock)
        finally:
            sock.close()

    def _on_message(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            msg = P.decode_msg(frames)
        except P.ProtocolError as e:
            log.error("bad message from trainer %s: %s", ident.hex(), e)
            return
        peer = self.peers.get(ident)
        if peer is None:
            peer = self.peers[ident] = Peer()
        peer.last_seen = time.monotonic()
        if isinstance(msg, P.Heartbeat) and msg.hello is not None and not peer.greeted:
            # A trainer we do not know (we restarted, it did not): resume from its heartbeat.
            peer.jobs, peer.follow, peer.credit, peer.greeted = msg.hello.jobs, msg.hello.follow, msg.window, True
            log.info("trainer %s resumed from its heartbeat (window %d)", ident.hex(), msg.window)
        if isinstance(msg, P.Hello):
            peer.jobs, peer.follow, peer.greeted = msg.jobs, msg.follow, True
        elif isinstance(msg, P.Credit):
            peer.credit += msg.n
        elif isinstance(msg, P.Received):
            for k in msg.keys:
                self.ledger.received(ident, k)
        elif isinstance(msg, P.Ack):
            for k in msg.keys:
                if self.ledger.ack(ident, k):
                    self.stats["acked"] += 1
                else:
                    self.stats["duplicate_acks"] += 1
        elif isinstance(msg, P.Fail):
            self.stats["trainer_failed"] += 1
            f = self.ledger.trainer_failed(ident, msg.key, msg.reason)
            if f:
                try:
                    P.resolve_in_spool(self.spool, f).unlink()
                except (FileNotFoundError, P.UnsafePathError):
                    pass

    def _dispatch(self, sock: zmq.Socket) -> None:
        now = time.monotonic()
        for ident, peer in list(self.peers.items()):
            if now - peer.last_seen > self.peer_timeout_s:
                log.warning("trainer %s silent for %.0f s: returning its leases", ident.hex(), now - peer.last_seen)
                self.stats["peers_lost"] += 1
                self.ledger.release_owner(ident, self._file_exists)
                del self.peers[ident]
                continue
            if not peer.greeted:
                continue  # no HELLO yet: we do not know which jobs it wants
            try:
                while peer.credit > 0:
                    s = self.ledger.lease_next(ident, peer.jobs)
                    if s is None:
                        break
                    assert s.notice is not None
                    d = P.Deliver(notice=s.notice, expected_token_ids=s.token_ids, loss_mask=s.loss_mask, label=s.label,
                                  lease_s=self.peer_timeout_s)
                    sock.send_multipart([ident, *P.encode_msg(d)])
                    peer.credit -= 1
                    self.stats["delivered"] += 1
                if not peer.follow and not peer.ended and self.ledger.jobs_done(peer.jobs):
                    sock.send_multipart([ident, *P.encode_msg(P.End(jobs=peer.jobs))])
                    peer.ended = True
            except zmq.ZMQError as e:  # peer vanished (ROUTER_MANDATORY): treat as lost
                log.warning("trainer %s unreachable (%s): returning its leases", ident.hex(), e)
                self.ledger.release_owner(ident, self._file_exists)
                del self.peers[ident]
