"""The sidecar's delivery endpoints: ROUTERs owned by one thread, trainers are DEALERs.

Credit-based flow control (ZeroMQ Guide, ch. 7): a trainer says how many samples it can
hold and never gets more. Every message from a trainer counts as a heartbeat; a trainer
silent for longer than ``peer_timeout_s`` is presumed dead and its leases go back (READY if
the file is still there, else QUEUED to be produced again), so nothing is lost. Heartbeats go
both ways: the sidecar sends one to each trainer it has not sent anything to for
``heartbeat_s``, and a trainer that hears nothing reconnects (``HiddenStateStream``).

Two sockets, one thread: the local one (``ipc://``) for trainers on this host, and optionally
a TCP one with CURVE authentication for trainers on other hosts. How each trainer gets the
bytes is its own choice, said in its HELLO (``connector/transport/``): it reads the spool
itself, or gets the bytes in the DELIVER (zmq), or reads them with the Mooncake Transfer Engine
from a registered mapping of the file; for the last two the sidecar deletes the file on RECEIVED.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
from pydantic import BaseModel

from connector import protocol as P
from connector import layouts as L
from connector.layouts import SidecarHalf
from connector.contract.rest import TrainerInfo
from connector.transport import Sender, TransportError, make_sender
from server.doorbell import Doorbell
from server.ledger import GROUP_MAX, Ledger, SampleRow
from server.ledger.store import LedgerUnsaved
from server.notices import prepare_ipc
from server.peers import Peer
from server.socket_thread import SocketThread

log = logging.getLogger("hsstream.sidecar")

Lease = tuple[P.SampleKey, str]  # a key and the lease token a trainer names it with

#: The delivery thread's longest sleep; heartbeats and lost trainers are looked at this often.
#: New READY samples and trainer messages wake it at once.
POLL_MS = 20
#: Seconds a trainer whose queue was full gets nothing new (unless it shows progress first):
#: without a pause every pass would lease, be refused and hand back the same samples.
STALLED_S = 0.5
#: Keys of ACK / RECEIVED / FAIL messages settled in one ledger group: the lock is held from
#: the group's first message to its commit, so this bounds how long any other thread waits.
GROUP_KEYS = 2048
#: Seconds between two tries to write the rows a full volume left waiting (``Ledger.flush``).
FLUSH_EVERY_S = 0.5


@dataclass(frozen=True)
class CurveServer:
    """Server key pair and the directory of authorised trainers' public keys (zmq.auth format)."""

    public: bytes
    secret: bytes
    clients_dir: str




class DeliveryService(SocketThread):
    name = "hsstream-delivery"

    def __init__(
        self,
        endpoint: str,
        spool: Path,
        ledger: Ledger,
        peer_timeout_s: float = 120.0,
        *,
        heartbeat_s: float = 1.0,
        remote_endpoint: str | None = None,
        curve: CurveServer | None = None,
        mooncake: Sender | None = None,
        max_credit: int = 256,
        send_hwm: int = 256,
        max_message_bytes: int = 1 << 20,
        max_hello_jobs: int = 1024,
        doorbell: Doorbell | None = None,
        on_unheld: Callable[[str, int], object] | None = None,
        layout: SidecarHalf | None = None,
        max_settle_keys: int = 1024,
        budget_bytes: int | None = None,
    ) -> None:
        """``max_message_bytes``: the largest message part a trainer may send (ZeroMQ drops the
        connection of one that sends more, before anything is parsed); ``max_hello_jobs``: the
        most jobs a HELLO may name (each delivery pass walks them under the ledger's lock).
        ``doorbell``: what other threads ring when they made samples READY (the notices thread,
        the submitter), so a new sample is offered at once rather than at the poll's timeout.
        ``on_unheld``: told (kind, keys) of each message's keys ignored for want of their lease
        token, e.g. the Prometheus counter. ``max_settle_keys``: the most keys an ACK or RECEIVED
        may name (a longer one is refused whole and counted, ``oversized_settlements``).
        ``budget_bytes``: the spool budget the trainers share (:meth:`_share`; None: no share
        rule, each trainer is bounded by ``max_credit`` alone)."""
        super().__init__()
        if max_credit < 1 or send_hwm < 1:
            raise ValueError(f"max_credit and send_hwm must be at least 1 (got {max_credit}, {send_hwm})")
        if remote_endpoint and curve is None:
            raise ValueError("a remote (TCP) delivery endpoint needs CURVE keys: tensors must not travel unauthenticated")
        self.endpoint = endpoint
        self.remote_endpoint = remote_endpoint
        self.curve = curve
        self.spool = spool
        self.ledger = ledger
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_s = heartbeat_s
        self.max_credit = max_credit
        self.send_hwm = send_hwm
        self.max_message_bytes = max_message_bytes
        self.max_hello_jobs = max_hello_jobs
        self.max_settle_keys = max_settle_keys
        self.budget_bytes = budget_bytes
        self.sample_bytes = 0  # the largest sample delivered yet (the room _share keeps for a newcomer)
        # owner id: b"L"/b"R" + socket identity; the order is the serving line (_dispatch)
        self.peers: OrderedDict[bytes, Peer] = OrderedDict()
        # delivered_remote: the bytes left through us (zmq or mooncake), also counted per transport.
        self.stats = {"delivered": 0, "delivered_remote": 0, "delivered_zmq": 0, "delivered_mooncake": 0, "acked": 0,
                      "duplicate_acks": 0, "trainer_failed": 0, "peers_lost": 0, "ack_errors": 0,
                      "orphans_deleted": 0, "send_refused": 0,
                      # messages that did not parse (not JSON, a field out of its bounds, ...): dropped
                      "bad_messages": 0,
                      # keys of ACK / RECEIVED / FAIL messages ignored: without the token of the
                      # sample's latest lease (never delivered to the sender, or a stale copy's)
                      "unheld_acks": 0, "unheld_receiveds": 0, "unheld_fails": 0,
                      # ACK / RECEIVED messages naming more than max_settle_keys keys: refused whole
                      "oversized_settlements": 0,
                      # passes in which a trainer at or over its share of the budget got nothing
                      "share_limited": 0,
                      # message groups whose ledger writes waited for a full volume (Ledger.degraded)
                      "unsaved_groups": 0}  # fmt: skip
        self.on_unheld = on_unheld
        #: The spool layout's sidecar half (connector/layouts/): a remote trainer's bytes of a
        #: sample that is not a file (an arena slot) come from it, and it says which transports
        #: it can serve. None: files.
        self.layout = layout if layout is not None else L.layout(L.DEFAULT).sidecar_class()()
        self._socks: dict[bytes, zmq.Socket] = {}
        # (sender, key, file) to release and delete once the messages' ledger group is on disk
        self._after: list[tuple[Sender, P.SampleKey, str | None]] | None = None
        # ... and those of groups whose writes wait for a full volume: once they are written
        self._after_flush: list[tuple[Sender, P.SampleKey, str | None]] = []
        self._flushed_at = 0.0
        # One sender per transport this sidecar offers; Mooncake only when configured.
        self.senders: dict[str, Sender] = {"spool": make_sender("spool"), "zmq": make_sender("zmq")}
        if mooncake is not None:
            self.senders["mooncake"] = mooncake
        # Opened in bind(), closed when serve() ends (or by close_wakeups() if it never ran).
        self.doorbell = doorbell if doorbell is not None else Doorbell()

    def trainers(self) -> list[TrainerInfo]:
        """The connected trainers, for the REST overview (read from another thread: a snapshot)."""
        now = time.monotonic()
        peers = sorted(list(self.peers.items()), key=lambda kv: kv[1].joined)
        return [p.info(owner, now) for owner, p in peers if p.greeted]

    def _file_exists(self, name: str) -> bool:
        return P.spool_file_exists(self.spool, name)

    def bind(self) -> object:
        ctx = zmq.Context.instance()
        prepare_ipc(self.endpoint)
        local = ctx.socket(zmq.ROUTER)
        local.setsockopt(zmq.LINGER, 0)
        local.setsockopt(zmq.ROUTER_MANDATORY, 1)
        local.setsockopt(zmq.SNDHWM, self.send_hwm)
        local.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        local.bind(self.endpoint)
        self._socks[b"L"] = local
        auth = None
        if self.remote_endpoint and self.curve:
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve(domain="*", location=self.curve.clients_dir)
            remote = ctx.socket(zmq.ROUTER)
            remote.setsockopt(zmq.LINGER, 0)
            remote.setsockopt(zmq.ROUTER_MANDATORY, 1)
            remote.setsockopt(zmq.SNDHWM, self.send_hwm)
            remote.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            remote.curve_server = True
            remote.curve_publickey = self.curve.public
            remote.curve_secretkey = self.curve.secret
            remote.bind(self.remote_endpoint)
            self._socks[b"R"] = remote
        self.doorbell.open()  # last: nothing to close if a bind above failed
        return auth

    def serve(self, auth: object) -> None:
        poller = zmq.Poller()
        for s in self._socks.values():
            poller.register(s, zmq.POLLIN)
        bell = self.doorbell.fileno()
        poller.register(bell, zmq.POLLIN)
        try:
            while not self.stopping:
                for sock, _ in poller.poll(POLL_MS):
                    if sock == bell:
                        self.doorbell.drain()  # a sample became READY on another thread
                        continue
                    tag = next(t for t, s in self._socks.items() if s is sock)
                    more = True
                    while more:
                        batch = []
                        while len(batch) < GROUP_MAX:
                            try:
                                batch.append(sock.recv_multipart(zmq.NOBLOCK))
                            except zmq.Again:
                                more = False
                                break
                        self._on_messages(tag, batch)
                try:
                    self._dispatch()
                except Exception:  # noqa: BLE001
                    log.exception("delivery pass failed")
                    time.sleep(0.1)
        finally:
            for s in self._socks.values():
                s.close()
            for sender in self.senders.values():
                sender.close()
            if auth is not None:
                auth.stop()  # type: ignore[attr-defined]
            self.close_wakeups()

    def close_wakeups(self) -> None:
        """Close the doorbell (the thread's end, or never started): rings from now on do nothing."""
        self.doorbell.close()

    def _on_messages(self, tag: bytes, batch: list[list[bytes]]) -> None:
        """The messages that arrived together: parsed first (outside the ledger's lock), then
        applied in ledger groups of at most :data:`GROUP_KEYS` keys (one commit each for their
        acks and receipts); files the sidecar deletes for remote trainers go once a group is on
        disk, or, when the volume refused it, once its writes are (``Ledger.flush``)."""
        group: list[tuple[bytes, BaseModel]] = []
        weight = 0
        for frames in batch:
            owner = tag + frames[0]
            msg = self._parse(owner, frames[1:])
            if msg is None:
                continue
            w = len(msg.keys) if isinstance(msg, (P.Ack, P.Received)) else 1
            if group and weight + w > GROUP_KEYS:
                self._apply(group)
                group, weight = [], 0
            group.append((owner, msg))
            weight += w
        if group:
            self._apply(group)

    def _apply(self, group: list[tuple[bytes, BaseModel]]) -> None:
        self._after = []
        saved = False
        try:
            with self.ledger.group():
                for owner, msg in group:
                    try:
                        self._handle(owner, msg)
                    except Exception:  # noqa: BLE001 - one bad message must not end the thread
                        log.exception("trainer message handling failed")
            saved = True
        except LedgerUnsaved as e:  # the volume refused the writes: they wait in memory, and so do the files
            self.stats["unsaved_groups"] += 1
            log.warning("%d trainer message(s) not on disk yet (%s): their files and offers are kept until they are",
                        len(group), e)  # fmt: skip
        except Exception:  # noqa: BLE001 - the commit failed: the trainers' leases lapse or are acked again
            log.exception("writing %d trainer message(s) to the ledger failed", len(group))
        finally:
            after, self._after = self._after or [], None
        if saved and not self.ledger.degraded:
            self._run_after(after)
        else:
            self._after_flush.extend(after)

    def _run_after(self, after: list[tuple[Sender, P.SampleKey, str | None]]) -> None:
        for sender, key, file in after:
            sender.release(key)
            P.remove_from_spool(self.spool, file)  # a remote trainer cannot delete our file: we do

    def _parse(self, owner: bytes, frames: list[bytes]) -> BaseModel | None:
        """A trainer's message, or None when it is refused here (another version, unparsable, an
        ACK or RECEIVED over ``max_settle_keys``): counted, and said once per trainer."""
        try:
            msg = P.decode_msg(frames)
        except P.VersionMismatch as e:
            self._refuse(owner, self._peer(owner), f"this sidecar speaks protocol version {P.PROTOCOL_VERSION}: {e}")
            return None
        except P.ProtocolError as e:
            self.stats["bad_messages"] += 1
            log.error("bad message from trainer %s: %s", owner.hex(), e)
            return None
        if isinstance(msg, (P.Ack, P.Received)) and len(msg.keys) > self.max_settle_keys:
            peer = self._peer(owner)  # it is alive all the same
            self.stats["oversized_settlements"] += 1
            if not peer.warned_oversized:
                peer.warned_oversized = True
                log.warning("trainer %s sent %s naming %d keys, over HSSTREAM_MAX_SETTLE_KEYS (%d): refused whole; "
                            "later ones are only counted (oversized_settlements)", owner.hex(), type(msg).__name__.upper(),
                            len(msg.keys), self.max_settle_keys)  # fmt: skip
            return None
        return msg

    def _on_message(self, owner: bytes, frames: list[bytes]) -> None:
        """One message as it came (its frames after the identity), outside any group."""
        if (msg := self._parse(owner, frames)) is not None:
            self._handle(owner, msg)

    def _handle(self, owner: bytes, msg: BaseModel) -> None:
        peer = self._peer(owner)
        hello = msg if isinstance(msg, P.Hello) else msg.hello if isinstance(msg, P.Heartbeat) else None
        if hello is not None and hello.jobs is not None and len(hello.jobs) > self.max_hello_jobs:
            self._refuse(owner, peer, f"its HELLO names {len(hello.jobs)} jobs; this sidecar follows at most "
                                      f"{self.max_hello_jobs} for one trainer (HSSTREAM_MAX_HELLO_JOBS)")  # fmt: skip
            return
        if isinstance(msg, P.Heartbeat) and msg.hello is not None and not peer.greeted:
            # A trainer we do not know (we restarted, it did not): resume from its heartbeat.
            peer.jobs, peer.follow, peer.greeted = msg.hello.jobs, msg.hello.follow, True
            peer.credit = min(msg.window, self.max_credit)
            self._set_transport(owner, peer, msg.hello)
            log.info("trainer %s resumed from its heartbeat (window %d)", owner.hex(), msg.window)
        if isinstance(msg, P.Heartbeat):
            peer.on_heartbeat(msg.alive_s, msg.waited_s, msg.train)
        if isinstance(msg, P.Hello):
            peer.jobs, peer.follow, peer.greeted = msg.jobs, msg.follow, True
            self._set_transport(owner, peer, msg)
        elif isinstance(msg, P.Credit):
            peer.credit = min(peer.credit + msg.n, self.max_credit)  # its window is a hint; ours is the cap
        elif isinstance(msg, P.Received):
            sender = self.senders.get(peer.transport)
            peer.stalled_until = 0.0  # it reads again
            for k, token in self._held(owner, peer, "receiveds", msg.pairs()):
                peer.let_go((k,))
                freed = self.ledger.received(owner, k, token, self._file_exists)
                if freed and sender is not None and sender.sidecar_deletes:
                    s = self.ledger.get(k)  # in flight (its bytes were just freed): from memory
                    file = s.notice.file if s and s.notice else None
                    self._delete_after_commit(sender, k, file)  # a remote trainer cannot delete our file: we do
        elif isinstance(msg, P.Ack):
            orphans: list[tuple[P.SampleKey, str]] = []
            pairs = self._held(owner, peer, "acks", msg.pairs())
            keys = [k for k, _ in pairs]
            try:
                acked, dup = self.ledger.ack_many(owner, keys, [t for _, t in pairs], orphans)
            except Exception:  # noqa: BLE001 - none of the list applied: do not leave it leased
                # Its leases go back (as for a lost trainer); a redelivered sample it already
                # acked is acked again by the stream on sight, so the ack is not lost.
                log.exception("ACK of %d key(s) from trainer %s failed: returning its leases", len(keys), owner.hex())
                self.stats["ack_errors"] += 1
                self._release_owner(owner)
                return
            self.stats["acked"] += acked
            peer.acked += acked
            # Acked before its RECEIVED, an arena slot stays the trainer's until its views die
            # (the ledger keeps it): it still counts against the trainer's share.
            peer.let_go(set(keys) - self.ledger.still_held(owner, keys))
            peer.stalled_until = 0.0
            self.stats["duplicate_acks"] += dup
            # Files of consumed samples no one will read (a copy produced again after a restart,
            # or one never RECEIVED): deleted with the ack, not left for the reaper.
            sender = self.senders[peer.transport]
            for k, file in orphans:
                self.stats["orphans_deleted"] += 1
                self._delete_after_commit(sender, k, file)
        elif isinstance(msg, P.Fail):
            if not self._held(owner, peer, "fails", [(msg.key, msg.token)]):
                return  # another trainer's offer is not freed either
            self.stats["trainer_failed"] += 1
            peer.let_go((msg.key,))
            gone = self.ledger.trainer_failed(owner, msg.key, msg.token, msg.reason, not_received=msg.not_received)
            if (sender := self.senders.get(peer.transport)) is not None:
                self._delete_after_commit(sender, msg.key, gone)
            else:
                P.remove_from_spool(self.spool, gone)

    def _held(self, owner: bytes, peer: Peer, kind: str, pairs: list[Lease]) -> list[Lease]:
        """The (key, token) pairs of a message that prove a lease (``Ledger.holds``); the rest
        are ignored here, counted (``unheld_<kind>``) and, once per trainer, logged: keys are
        guessable, so a peer may name samples it was never delivered (or a copy's lease that
        another lease replaced since)."""
        held = [p for p, ok in zip(pairs, self.ledger.holds_many(pairs), strict=True) if ok]
        if (bad := len(pairs) - len(held)) == 0:
            return held
        self.stats[f"unheld_{kind}"] += bad
        if self.on_unheld is not None:
            self.on_unheld(kind, bad)
        if not peer.warned_unheld:
            peer.warned_unheld = True
            log.warning("trainer %s settled %d sample(s) without their lease token (%s): ignored; later ones "
                        "are only counted (unheld_%s)", owner.hex(), bad, kind.upper()[:-1], kind)  # fmt: skip
        return held

    def _peer(self, owner: bytes) -> Peer:
        peer = self.peers.get(owner)
        if peer is None:
            peer = self.peers[owner] = Peer(remote=owner[:1] == b"R")
        peer.last_seen = time.monotonic()
        return peer

    def _refuse(self, owner: bytes, peer: Peer, why: str) -> None:
        """Serve a trainer nothing, and say why once: an END with the reason, which the stream
        raises (one of another protocol version fails to parse it and raises the version error)."""
        if peer.refused:
            return
        peer.refused = peer.ended = True
        peer.greeted = False  # never served: _dispatch skips it until its timeout
        log.warning("trainer %s refused: %s", owner.hex(), why)
        try:
            self._send(owner, P.encode_msg(P.End(jobs=None, reason=f"refused: {why}")))
        except zmq.ZMQError:
            pass  # refused all the same

    def _delete_after_commit(self, sender: Sender, key: P.SampleKey, file: str | None) -> None:
        """Free a sample's offer and delete its file, once the ledger group that decided it is
        on disk (inside :meth:`_on_messages`), else at once."""
        if self._after is not None:
            self._after.append((sender, key, file))
        else:
            sender.release(key)
            P.remove_from_spool(self.spool, file)

    def _set_transport(self, owner: bytes, peer: Peer, hello: P.Hello) -> None:
        peer.transport = hello.wanted_transport()
        served = self.layout.served_transports
        if served is not None and peer.transport not in served:
            why = (f"this sidecar's spool is an {self.layout.name} (HSSTREAM_SPOOL_LAYOUT={self.layout.name}): it serves "
                   f"transports {', '.join(served)}, not {peer.transport!r} (which needs files: HSSTREAM_SPOOL_LAYOUT=files)")
            log.warning("trainer %s: %s", owner.hex(), why)
            try:
                self._send(owner, P.encode_msg(P.End(jobs=peer.jobs, reason=why)))
            except zmq.ZMQError:
                pass
            peer.ended = True
            return
        if peer.transport not in self.senders:
            # Refused with a reason the stream raises, rather than bytes it could not read.
            why = (f"this sidecar does not offer transport {peer.transport!r} (it offers {', '.join(self.senders)}; "
                   "Mooncake needs HSSTREAM_MOONCAKE_HOSTNAME on the sidecar)")  # fmt: skip
            log.warning("trainer %s: %s", owner.hex(), why)
            try:
                self._send(owner, P.encode_msg(P.End(jobs=peer.jobs, reason=why)))
            except zmq.ZMQError:
                pass  # it is refused all the same: nothing is ever sent to it
            peer.ended = True

    def _release_owner(self, owner: bytes) -> None:
        """A trainer's leases go back (lost, or its ACK list failed); what was offered to it is freed."""
        for sender in self.senders.values():
            sender.release_owner(owner)
        self.ledger.release_owner(owner, self._file_exists)
        if (peer := self.peers.get(owner)) is not None:
            peer.let_go_all()

    def _send(self, owner: bytes, frames: list) -> None:
        """Never waits: a trainer whose queue is full (``send_hwm`` messages it has not read)
        raises ``zmq.Again`` here, one that is gone ``zmq.ZMQError`` (ROUTER_MANDATORY). The one
        thread serves every trainer, lease lapses and heartbeats: a send that waited for one
        trainer to read would stop them all."""
        self._socks[owner[:1]].send_multipart([owner[1:], *frames], flags=zmq.NOBLOCK, copy=False)
        if (peer := self.peers.get(owner)) is not None:
            peer.last_sent = time.monotonic()

    def _share(self) -> int | None:
        """Each trainer's share of the spool budget (None without a budget: no share rule):

        - with N trainers being served (greeted, not ended, not refused; every DDP rank is a
          stream of its own and counts as one), the budget / N;
        - a trainer alone, the whole budget but the room of one sample (the largest delivered
          yet): a trainer that never lets go cannot take it all before another one comes, or
          the newcomer would wait for samples no budget is left to produce.
        """
        if self.budget_bytes is None:
            return None
        n = sum(1 for p in self.peers.values() if p.greeted and not p.ended and not p.refused)
        if n <= 1:
            return max(self.budget_bytes - self.sample_bytes, self.sample_bytes)
        return self.budget_bytes // n

    def _prune(self, owner: bytes, peer: Peer) -> None:
        """Keys it will never confirm (a lease that lapsed and went elsewhere, a copy it dropped)
        must not count for ever: keep only what the ledger still has with it, unreceived."""
        peer.let_go(set(peer.holding) - self.ledger.still_held(owner, list(peer.holding)))

    def _room(self, owner: bytes, peer: Peer, share: int | None = None) -> tuple[int, int | None]:
        """Samples to lease it now, and the bytes they may take: its credit, within what the
        server lets one trainer hold (``max_credit`` samples and its ``share`` of the budget,
        counting what it was sent and has not yet RECEIVED). A trainer at or over its share gets
        nothing new until it lets some go; one that holds nothing may take one sample whatever
        its size (a sample larger than a share is not stuck)."""
        over_share = share is not None and peer.holding and peer.held_bytes >= share
        if len(peer.holding) >= self.max_credit or over_share:
            self._prune(owner, peer)
        n = min(peer.credit, self.max_credit - len(peer.holding))
        if share is None or n <= 0:
            return n, None
        if not self.sample_bytes:  # the first delivery tells the sample size (the room a share keeps)
            n = 1
        if peer.holding and peer.held_bytes >= share:
            self.stats["share_limited"] += 1
            return 0, 0
        return n, share - peer.held_bytes

    def _hand_back(self, owner: bytes, peer: Peer, samples: list[SampleRow]) -> None:
        """Leases whose DELIVER never left (the trainer's queue is full): READY again at once,
        for any trainer, and the trainer gets nothing new for a while."""
        self.stats["send_refused"] += 1
        first = peer.stalled_until == 0.0  # the first refusal since it last showed progress: say so once
        peer.stalled_until = time.monotonic() + STALLED_S
        sender = self.senders[peer.transport]
        for s in samples:
            sender.release(s.key)
        self.ledger.unlease(owner, [s.key for s in samples], self._file_exists)
        (log.warning if first else log.debug)(
            "trainer %s does not read (its queue of %d messages is full): %d lease(s) handed back",
            owner.hex(), self.send_hwm, len(samples))  # fmt: skip

    def _dispatch(self) -> None:
        now = time.monotonic()
        if self.ledger.degraded and now - self._flushed_at > FLUSH_EVERY_S:
            self._flushed_at = now
            if self.ledger.flush():
                log.warning("the ledger's waiting rows are written: back to normal")
        if self._after_flush and not self.ledger.degraded:
            after, self._after_flush = self._after_flush, []
            self._run_after(after)
        share = self._share()
        for owner, peer in list(self.peers.items()):
            if now - peer.last_seen > self.peer_timeout_s:
                log.warning("trainer %s silent for %.0f s: returning its leases", owner.hex(), now - peer.last_seen)
                self.stats["peers_lost"] += 1
                self._release_owner(owner)
                del self.peers[owner]
                continue
            if not peer.greeted or peer.ended:
                # No HELLO yet (we do not know which jobs it wants), or its jobs are done: a
                # closed stream's peer lingers until its timeout, and must cost nothing meanwhile.
                continue
            try:
                if now - peer.last_sent > self.heartbeat_s:
                    # Heartbeats both ways (ZeroMQ Guide, ch. 4): a trainer that hears nothing from
                    # us for a while reconnects instead of waiting out its whole timeout.
                    try:
                        self._send(owner, P.encode_msg(P.Heartbeat()))
                    except zmq.ZMQError:
                        # A full queue (it has plenty to read), or unreachable: handled on its
                        # next delivery, or by its timeout.
                        pass
                if peer.stalled_until > now:
                    continue
                peer.share_bytes = share
                if not self.ledger.degraded:  # no lease while the ledger cannot write it
                    before = peer.delivered
                    self._deliver(owner, peer, share)
                    if peer.delivered != before and owner in self.peers:
                        # Round robin: a trainer just served goes to the back of the line, or
                        # the first one greeted would take every sample produced one at a time
                        # (once 360 of 400 against an equal peer's 40).
                        self.peers.move_to_end(owner)  # atomic: trainers() never misses it
                if not peer.follow and not peer.ended and self.ledger.jobs_done(peer.jobs):
                    self._send(owner, P.encode_msg(P.End(jobs=peer.jobs)))
                    peer.ended = True
            except zmq.Again:
                pass  # an END its full queue refused: sent again on a later pass
            except zmq.ZMQError as e:  # peer vanished (ROUTER_MANDATORY): treat as lost
                log.warning("trainer %s unreachable (%s): returning its leases", owner.hex(), e)
                self._release_owner(owner)
                del self.peers[owner]
        if share is not None:  # what no waiting frees: the budget's watermark leaves it out
            self.ledger.pinned_bytes = sum(p.held_bytes for p in self.peers.values()
                                           if p.holding and p.held_bytes >= share)  # fmt: skip

    def _deliver(self, owner: bytes, peer: Peer, share: int | None = None) -> None:
        """Lease what it has room for, in one commit before any DELIVER leaves, and send them;
        what its full queue refuses goes back at once."""
        n, max_bytes = self._room(owner, peer, share)
        if n <= 0:
            return
        leased = self.ledger.lease_many(owner, peer.jobs, n, max_bytes=max_bytes, at_least_one=not peer.holding)
        sender = self.senders[peer.transport]
        for i, s in enumerate(leased):
            assert s.notice is not None
            d = P.Deliver(notice=P.stamp_sidecar_queue(s.notice, time.time()), expected_token_ids=s.token_ids,
                          loss_mask=s.loss_mask, label=s.label, lease_s=self.peer_timeout_s,
                          token=s.lease_token or "")  # fmt: skip
            try:
                # Only a sender that moves the bytes opens the file (the spool's trainer does itself).
                # A remote trainer of a sample that is no file (an arena slot): its layout's bytes.
                if sender.sidecar_deletes and (own := self.layout.payload_of(s.notice)) is not None:
                    transfer, payload = None, own
                else:
                    path = P.resolve_in_spool(self.spool, s.notice.file or "") if sender.sidecar_deletes else None
                    transfer, payload = sender.offer(owner, s.key, path)
            except (OSError, P.UnsafePathError, TransportError) as e:
                if isinstance(e, TransportError):
                    log.error("%s: %s", peer.transport, e)
                stale = s.notice.file
                self.ledger.file_lost(s.key)  # produce it again
                # A transport's failure leaves the file there, now no sample's: not the reaper's.
                P.remove_from_spool(self.spool, stale)
                continue
            if transfer is not None:
                d = d.model_copy(update={"transfer": transfer})
            try:
                self._send(owner, P.encode_msg(d, payload))
            except zmq.Again:
                self._hand_back(owner, peer, leased[i:])
                return
            except zmq.ZMQError:
                sender.release(s.key)  # the rest of its leases go back with it (_dispatch)
                raise
            if sender.sidecar_deletes:
                self.stats["delivered_remote"] += 1
                self.stats[f"delivered_{sender.name}"] += 1
            peer.hold(s.key, s.on_disk_bytes)
            self.sample_bytes = max(self.sample_bytes, s.on_disk_bytes)
            peer.credit -= 1
            peer.delivered += 1
            self.stats["delivered"] += 1
