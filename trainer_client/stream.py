"""``HiddenStateStream``: what a training loop iterates over.

The loop should not think about files, sockets or acknowledgements. The stream asks the
sidecar for samples with credit (never more in flight than it can hold), validates each
sample before yielding it (a bad one is reported failed and regenerated, never yielded),
deletes the spool file as soon as the tensors are in memory (the spool is the producer's
budget), and acknowledges at use or when the loop says so (``ack_through``), so samples used
after the last checkpoint come back after a crash. Only the iterating thread touches the
socket; a burst of deliveries is read and checked by a few workers (``check_pool.py``) whose
results come back to it, as they finish (or in delivery order: ``ordered``).

This module is the client (the socket, credit, leases, acks). What it yields is
``sample.py``'s :class:`Sample`; a delivery is read by ``sample_reader.py``, checked by
``sample_checks.py`` (finiteness: ``finite.py``) and copied to a GPU by ``device_copy.py``.

The arena layout (``connector/contract/arena.py``: ``notice.slot`` set, ``file`` None): the
sample is read in place, its hidden states yielded as views of this process's copy-on-write
mapping of the arena's slot (unless copied to a CUDA device or into pinned memory), and nothing
is renamed or deleted. An in-place op on them changes this trainer's private pages only. The
slot's bytes are in use until no view of them is alive: until then it is held (a read lock on
its bytes, which the sidecar's void cannot get past: the slot is never given to another sample
meanwhile, whatever the sidecar believes, a restarted one included). Its RECEIVED (on which the
sidecar frees the slot for another sample) waits for that too: a ``weakref.finalize`` on the
array under the views (any thread, often the loop's own, when it drops a sample) lets go of the
hold and only queues the slot, and the iterating thread, which alone owns the socket, sends the
RECEIVED when it next runs (each turn of its loop, each wakeup of its poll, ``ack_through``,
close). ACKs are not held back for it: a loop that asks for the next sample while it still holds
the last one (``for x in stream``) acks it as usual, and the sidecar keeps a consumed sample's
slot until its RECEIVED (or until this trainer is gone; the hold keeps it out of the free list
after that), so no slot is reused under a live view. A loop that keeps views for good keeps
their slots: production slows (the arena fills), nothing is overwritten. At
:meth:`close`, the yielded samples that still view their slots (the last one of a loop, still
in its variable) get private copies of their tensors, so they stay valid and their RECEIVEDs
go; only tensors the loop took out of a sample itself (``h = x.hidden_states``) keep their
slots for as long as they live. A sample dequantised by the stream (FP8 → ``dequantize``) holds
no view: its slot is released as soon as it is decoded.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.auth

from connector.contract import endpoints as E
from connector.contract import messages as M
from connector.contract import sample_file as SF
from connector.contract import spool as SP
from connector.contract.curve_keys import load_secret
from connector.contract.sample_file import InvalidSample
from connector.contract.settings import Settings, lower_switch_interval
from connector import layouts as L
from connector.transport import REGISTRY as TRANSPORTS
from connector.transport import Receiver, TransportError, receiver_from_settings
from trainer_client.check_pool import CheckPool
from trainer_client.device_copy import DeviceCopy, to_device_checked
from trainer_client.finite import all_finite
from trainer_client.host_buffers import HostBuffers
from trainer_client.sample import Sample
from trainer_client.sample_checks import load_and_check, read_hidden_states
from trainer_client.sample_reader import SlotNotReadable, read_into_buffer, read_parallel, read_sample_file
from trainer_client.slot_holds import SlotHolds, is_slot

#: The stream's public names, with those of the modules it is built from (the sample, its reading
#: and checks), so ``from trainer_client.stream import …`` reaches them all.
__all__ = ["ACK_KEYS", "DeviceCopy", "HiddenStateStream", "InvalidSample", "Sample", "StreamError", "StreamOptions",
           "all_finite", "load_and_check", "read_hidden_states", "read_into_buffer", "read_parallel",
           "read_sample_file", "to_device_checked"]

log = logging.getLogger("hsstream.trainer")


class StreamError(RuntimeError):
    pass


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)  # the reaper may have been first


#: Most keys in one ACK message (the deferred acks of a checkpoint can be many thousands): about
#: 100 bytes each, far below the sidecar's HSSTREAM_MAX_PEER_MESSAGE_BYTES.
ACK_KEYS = 1024


@dataclass(frozen=True)
class StreamOptions:
    """Everything a :class:`HiddenStateStream` can be told beside its endpoint; each field is
    also a keyword argument of the stream, with the same name and default.

    ``jobs``: the jobs to follow (None: every job); ``follow``: keep waiting after they
    complete. ``spool_dir`` (default ``HSSTREAM_SPOOL_DIR``): the spool a ``spool`` transport
    reads. ``credit``: samples in flight at most. ``ack``: ``"use"`` acknowledges a sample when
    the next one is requested, ``"manual"`` waits for :meth:`HiddenStateStream.ack_through` /
    ``ack_all_used``. ``timeout_s``: how long without a sample before the stream gives up;
    ``heartbeat_s``: how often it heartbeats; ``sidecar_silence_s``: how long a silent sidecar
    is waited for before the stream reconnects.

    ``curve_server_key`` is the sidecar's public key (or its ``.key`` file),
    ``curve_client_cert`` this trainer's ``.key_secret`` file, whose public half must be in the
    sidecar's clients directory. Without them a ``tcp://`` endpoint is refused
    (``InsecureEndpoint``) unless ``HSSTREAM_ALLOW_INSECURE_TCP=1``.

    ``transport`` (default ``HSSTREAM_TRANSPORT``, else ``spool`` for ``ipc://`` and ``zmq``
    for ``tcp://``): how the bytes come (``connector/transport/``). ``spool`` reads the
    file on this host; ``zmq`` gets them in the sidecar's message; ``mooncake`` reads them
    from the sidecar's host with the Mooncake Transfer Engine (the sidecar needs
    ``HSSTREAM_MOONCAKE_HOSTNAME``; this host's address is ``HSSTREAM_MOONCAKE_HOSTNAME``
    here, else the one on the route to the sidecar).

    ``acked_memory``: how many of the latest acked keys the stream remembers, so that a
    sample redelivered before the sidecar saw our ack (ack still queued, lease lapsed, sidecar
    restarted) is dropped, never yielded twice. Older keys are the ledger's to remember: once
    the sidecar has the ack the sample is CONSUMED and never delivered again.

    ``pin_memory``: samples are read into page-locked memory (for ``non_blocking`` copies
    to a GPU). ``idle_s``: the iterator yields ``None`` after that long without a sample,
    so a loop on the socket's thread can do other work (a collective with other ranks, a
    checkpoint and its acks) instead of blocking while it holds unacknowledged samples.

    ``dequantize``: the dtype encoded payloads (FP8, ``HSSTREAM_PAYLOAD_DTYPE=fp8_e4m3``) are
    turned into before they are yielded, after validation; None yields them as stored (FP8
    ``hidden_states`` + ``sample.scales``) for a trainer that dequantises on its GPU.
    Unencoded payloads are yielded as they are either way.

    ``workers`` (default ``HSSTREAM_STREAM_WORKERS``): threads that read and check delivered
    samples (``check_pool.py``), so a burst of deliveries is checked in parallel instead of
    queueing behind one thread; 0 checks each on the iterating thread. Only the iterating
    thread touches the socket. At most ``credit`` samples are held in the pool (its memory
    bound). ``ordered`` (default ``HSSTREAM_STREAM_ORDERED``, off): samples are yielded in
    delivery order; off, each as soon as it is checked (the sidecar's delivery order is
    vLLM's completion order anyway, so nothing a trainer relies on is lost, and a sample
    checked first is not held behind an older one).

    ``device`` (the trainer's, e.g. ``"cuda:0"``): each sample's hidden states are copied
    there by the worker that checked it, and their finiteness is checked there instead of on
    the host; the yielded ``hidden_states`` live on that device. Implies ``pin_memory``.
    None or CPU: checked on the host. ``host_buffers``: where pinned samples are read into
    (``host_buffers.py``; by default torch's pinned cache, warmed at the first delivery).

    ``rescan_finite`` (off): on the host, scan every sample's values for a NaN or an infinity
    even where the writer said they are all finite (``Notice.finite``: found in the pass that
    took its checksum). Off, a matching checksum stands for that scan — these are the bytes
    the writer scanned — and a CPU trainer reads each sample once instead of twice. A writer
    that found non-finite values has its sample refused either way.

    ``verify_slots`` (off): take the checksum of a slot read in place, too (the arena layout).
    Off, a slot's bytes are trusted without one: no writer but the slot's own ever writes it
    (the claim and the lease), no one writes it again while this trainer holds it, and the
    trainer's own in-place ops stay in its copy-on-write pages (``connector/contract/arena.py``).
    On, it costs a pass over every sample's bytes; it checks them when read, not after (another
    process of this user writing the arena file itself).
    """

    jobs: list[str] | None = None
    spool_dir: str | os.PathLike[str] | None = None
    credit: int = 8
    ack: str = "use"
    follow: bool = False
    timeout_s: float = 600.0
    heartbeat_s: float = 2.0
    sidecar_silence_s: float = 10.0
    curve_server_key: str | bytes | None = None
    curve_client_cert: str | os.PathLike[str] | None = None
    acked_memory: int = 65536
    pin_memory: bool = False
    idle_s: float | None = None
    transport: str | None = None
    dequantize: torch.dtype | None = torch.bfloat16
    workers: int | None = None
    device: torch.device | str | None = None
    host_buffers: HostBuffers | None = None
    ordered: bool | None = None
    rescan_finite: bool = False
    verify_slots: bool = False


class HiddenStateStream:
    """Iterate samples from a sidecar. Use as a context manager so leases are returned.

    ``ack="use"`` acknowledges a sample when the next one is requested (the loop is done
    with it); ``ack="manual"`` waits for :meth:`ack_through` / :meth:`ack_all_used`.
    """

    def __init__(self, endpoint: str | None = None, *, options: StreamOptions | None = None, **kw: Any) -> None:
        """``endpoint`` ``ipc://…`` reads the spool on this host; ``tcp://…`` is a remote
        sidecar, authenticated with CURVE (``curve_server_key``, ``curve_client_cert``). Every
        other setting is a :class:`StreamOptions` field, given as ``options=`` or as a keyword
        argument of the same name (keywords override ``options``); an unknown keyword is a
        TypeError."""
        o = replace(options, **kw) if options is not None else StreamOptions(**kw)
        self.options = o
        jobs, spool_dir, credit, ack, follow = o.jobs, o.spool_dir, o.credit, o.ack, o.follow
        timeout_s, heartbeat_s, sidecar_silence_s = o.timeout_s, o.heartbeat_s, o.sidecar_silence_s
        curve_server_key, curve_client_cert, acked_memory = o.curve_server_key, o.curve_client_cert, o.acked_memory
        pin_memory, idle_s, transport, dequantize = o.pin_memory, o.idle_s, o.transport, o.dequantize
        workers, device, host_buffers, ordered = o.workers, o.device, o.host_buffers, o.ordered
        s = Settings()
        self.endpoint = endpoint or s.delivery_ep()
        self.spool = Path(spool_dir or s.spool_dir)
        self.jobs = jobs
        self.credit = max(1, credit)
        if ack not in ("use", "manual"):
            raise ValueError("ack must be 'use' or 'manual'")
        self.ack_mode = ack
        self.follow = follow
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.sidecar_silence_s = sidecar_silence_s  # the sidecar heartbeats every second
        self._last_recv = time.monotonic()
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._acked: OrderedDict[M.SampleKey, None] = OrderedDict()  # newest last, at most acked_memory
        self.acked_memory = max(1, acked_memory)
        self._used: list[M.SampleKey] = []  # yielded, not yet acked, in order
        self._used_set: set[M.SampleKey] = set()
        # The lease token of each admitted, not yet acked key's latest DELIVER: the sidecar
        # counts an ACK only with it, and a redelivery (a lapsed lease, a sidecar restart) replaces it.
        self._tokens: dict[M.SampleKey, str] = {}
        self._last_send = 0.0
        self._last_beat = 0.0
        self._started: float | None = None  # first __iter__
        self._waited = 0.0  # seconds the loop spent in the stream waiting for a sample
        self._waiting_since: float | None = None  # inside __iter__, not yet yielded
        self._report: M.TrainReport | None = None  # the loop's latest figures (report())
        self._outbox: deque[list[bytes]] = deque()
        self.remote = E.is_network(self.endpoint) and not E.is_abstract(self.endpoint)  # another host's
        if bool(curve_server_key) != bool(curve_client_cert):
            raise ValueError("CURVE needs both curve_server_key and curve_client_cert")
        self._curve = (curve_server_key, curve_client_cert) if curve_server_key else None
        # tcp:// or an abstract ipc://@ without CURVE: refused unless HSSTREAM_ALLOW_INSECURE_TCP=1 (then a WARNING)
        if E.is_network(self.endpoint) and self._curve is None:
            E.check_plain("HiddenStateStream endpoint", self.endpoint, allow=s.allow_insecure_tcp,
                          exposes=E.DELIVERY_EXPOSES, fix=E.STREAM_FIX)  # fmt: skip
        self.transport = transport or s.transport or ("zmq" if self.remote else "spool")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r}: one of {', '.join(TRANSPORTS)}")
        if self.remote and TRANSPORTS[self.transport].same_host_only:
            raise ValueError(f"{self.endpoint} is remote: its spool is on another host (transport zmq or mooncake)")
        self._settings = s
        self._receiver: Receiver | None = None  # built at the first connection (Mooncake starts an engine)
        self._hello = M.Hello(jobs=jobs, follow=follow, same_host=not self.remote, transport=self.transport)
        self.device = torch.device(device) if device is not None else None
        on_gpu = self.device is not None and self.device.type != "cpu"
        self.pin_memory = pin_memory or on_gpu
        self.host_buffers = host_buffers or HostBuffers(pinned=self.pin_memory)
        self.workers = s.stream_workers if workers is None else workers
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (got {self.workers})")
        self.ordered = s.stream_ordered if ordered is None else ordered
        self._pool = CheckPool(self.workers, limit=self.credit, ordered=self.ordered)
        if self.workers:
            lower_switch_interval(s.switch_interval_ms)  # the socket's thread vs the workers' Python
        # Spool files of checked samples are renamed out of the spool on the socket's thread and
        # deleted here: freeing a large tmpfs file takes milliseconds, which would sit between a
        # sample's check and its yield. Bounded (finished deletes are collected every loop); past
        # the bound a file is deleted inline. Such a sample's RECEIVED (the sidecar frees its spool
        # budget on it) waits for its delete: sent at once, the spool would hold the renamed bytes
        # on top of the budget until the deleter got to them.
        self._deletes = CheckPool(1 if self.workers else 0, limit=4 * self.credit + 16, ordered=False)
        self._held: dict[M.SampleKey, str | None] = {}  # keys in the pool -> their files
        self._view_job: Future | None = None  # the job reading the transport's reused buffer
        self.idle_s = idle_s
        self.dequantize = dequantize
        # wait_s: time the iterator spent with nothing from the sidecar (waiting for data);
        # load_s: reading and validating samples (summed over the workers); check_wait_s: time
        # the iterator waited for a worker with nothing else to do.
        # bytes_copied: host bytes copied to get the yielded samples' tensors (a file read into a
        # buffer, a transport's payload copied or parsed, a slot copied out into pinned memory, the
        # token ids out of a slot), counted where the copies are made; not a mapped file's or a
        # slot's pages read in place, not copies to a device (sample_checks.load_and_check).
        self.stats = {"delivered": 0, "yielded": 0, "invalid": 0, "not_received": 0, "duplicates": 0, "bytes": 0,
                      "bytes_copied": 0, "reconnects": 0, "wait_s": 0.0, "load_s": 0.0,
                      "check_wait_s": 0.0}  # fmt: skip
        # The spool layouts' reader halves (connector/layouts/: the arena's maps the spool's arena
        # at the first slot). The arena layout (module docstring): each slot delivered and not yet
        # RECEIVED; the slots whose views are gone (from any thread); ACKs waiting for their
        # sample's RECEIVED.
        self._readers = L.Readers(self.spool)
        self._slots = SlotHolds(self._send)
        self._unread_run = 0  # deliveries in a row whose file could not be read (_not_received)
        self.lease_s: float | None = None  # the sidecar's lease on what it delivers (from the DELIVERs)

    @property
    def unacked(self) -> int:
        """Samples delivered to this stream and neither acknowledged nor refused: what the sidecar
        hands out again (after :attr:`lease_s` of silence) if the stream goes away now."""
        return len(self._tokens)

    @property
    def slots_held(self) -> int:
        """Arena slots of checked samples whose RECEIVED waits for their views to go."""
        return self._slots.waiting

    @property
    def pool_stats(self) -> dict[str, int]:
        """The most deliveries the check pool ever held and ever checked at once (``check_pool.py``)."""
        return {"max_held": self._pool.max_held, "max_running": self._pool.max_running}

    @property
    def waited_s(self) -> float:
        """Seconds the loop has spent in the stream waiting for samples (the wait under way too)."""
        now = time.monotonic()
        return self._waited + (now - self._waiting_since if self._waiting_since is not None else 0.0)

    def report(self, *, step: int, loss: float | None = None, steps_per_s: float | None = None,
               samples_per_s: float | None = None) -> None:
        """The loop's latest training figures, for the sidecar's ``/metrics`` and overview: the
        next heartbeat carries them (and every one after, until the next report). Cheap enough
        for every step: it only validates and stores them (one reference, replaced whole, so
        any thread may call it). Raises ``ValueError`` for what the sidecar would refuse — a
        figure that is not finite, negative or past its bound (``messages.REPORT_MAX_*``)."""
        try:
            self._report = M.TrainReport(
                step=int(step), loss=None if loss is None else float(loss),
                steps_per_s=None if steps_per_s is None else float(steps_per_s),
                samples_per_s=None if samples_per_s is None else float(samples_per_s),
            )  # fmt: skip
        except ValueError as e:  # pydantic's ValidationError is one
            raise ValueError(f"training report refused: {e}") from e

    def _heartbeat(self) -> M.Heartbeat:
        alive = time.monotonic() - self._started if self._started is not None else 0.0
        return M.Heartbeat(hello=self._hello, window=self.credit, alive_s=round(alive, 3),
                           waited_s=round(min(self.waited_s, alive), 3), train=self._report)  # fmt: skip

    # -- socket -------------------------------------------------------------------------------
    def _connect(self) -> zmq.Socket:
        if self._receiver is None:
            try:
                self._receiver = receiver_from_settings(self.transport, self._settings, self.endpoint)
            except TransportError as e:
                raise StreamError(str(e)) from e
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)
            if self.remote and self._curve is not None:
                server_key, cert = self._curve
                if isinstance(server_key, str) and os.path.exists(server_key):
                    server_key = zmq.auth.load_certificate(server_key)[0]
                pub, sec = load_secret(cert)  # refuses a secret others can read
                if sec is None:
                    raise ValueError(f"{cert} holds no secret key (pass the .key_secret file)")
                sock.curve_serverkey = server_key.encode() if isinstance(server_key, str) else server_key
                sock.curve_publickey, sock.curve_secretkey = pub, sec
            sock.connect(self.endpoint)
            self._sock = sock
            self._last_recv = time.monotonic()
            self._outbox.appendleft(M.encode_msg(M.Credit(n=self.credit)))
            self._outbox.appendleft(M.encode_msg(self._hello))
            self._flush()
        return self._sock

    def _reconnect(self) -> zmq.Socket:
        """The sidecar has been silent (it heartbeats every second): drop the connection and
        start a fresh one (the ZeroMQ Guide's Paranoid Pirate). Acks still queued are kept;
        the old credit is replaced by a new HELLO and full window. Samples the old connection
        held come back to us or another trainer when their leases lapse; one we still hold
        unacked is dropped on redelivery, one we acked is acked again."""
        log.warning("sidecar at %s silent for %.0f s: reconnecting", self.endpoint, time.monotonic() - self._last_recv)
        self.stats["reconnects"] += 1
        credit = M.MsgType.credit.value.encode()
        kept = [m for m in self._outbox if m[0] != credit]
        self._outbox.clear()
        self._outbox.extend(kept)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        return self._connect()

    def _send(self, body) -> None:  # noqa: ANN001
        """Queue a message and send what can go now. Never blocks: with no sidecar connected
        (not up yet, restarting, or refusing our CURVE key) ZeroMQ would block the training
        loop; instead acks and credit wait in order in the outbox until a peer is there."""
        self._outbox.append(M.encode_msg(body))
        self._flush()

    def _flush(self) -> None:
        assert self._sock is not None
        while self._outbox:
            try:
                self._sock.send_multipart(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()
            self._last_send = time.monotonic()

    # -- acknowledgement ------------------------------------------------------------------------
    def ack_through(self, key: M.SampleKey) -> None:
        """Acknowledge every yielded sample up to and including ``key`` (e.g. at a checkpoint)."""
        if key not in self._used:
            return
        i = self._used.index(key)
        self._ack(self._used[: i + 1])
        self._used_set.difference_update(self._used[: i + 1])
        del self._used[: i + 1]

    def ack_all_used(self) -> None:
        self._ack(self._used)
        self._used = []
        self._used_set.clear()

    def _ack(self, keys: list[M.SampleKey]) -> None:
        keys = [k for k in keys if k not in self._acked]
        if keys and self._sock is not None:
            self._collect_deletes(wait_for=set(keys))  # a sample's RECEIVED before its ACK
            self._drain_released()
            self._send_acks([(k, self._tokens.pop(k, "")) for k in keys])
            for k in keys:
                self._acked[k] = None
            while len(self._acked) > self.acked_memory:
                self._acked.popitem(last=False)

    def _send_acks(self, pairs: list[tuple[M.SampleKey, str]]) -> None:
        """ACK ``pairs`` (key, token), a bounded number of keys per message."""
        ready = pairs
        for lo in range(0, len(ready), ACK_KEYS):  # each message well within the sidecar's size limit
            part = ready[lo : lo + ACK_KEYS]
            self._send(M.Ack(keys=[k for k, _ in part], tokens=[t for _, t in part]))

    # -- the arena layout's slots (slot_holds.py) ------------------------------------------------------
    def _drain_released(self) -> None:
        """The RECEIVEDs of the slots whose views are gone (on the iterating thread, connected)."""
        if self._sock is not None:
            self._slots.drain()

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Sample]:
        """Samples as they are checked (``ordered``: in delivery order). Each delivery is
        admitted here (duplicates dropped), read and checked by a worker, and settled here when
        the pool hands it back (``ordered``: when it is the oldest held): FAIL for an invalid
        one, else its file removed (renamed away, freed by the deleter, RECEIVED once it has)
        and the sample yielded. One CREDIT goes back per delivery when it leaves the pool
        (settled) or is dropped, so at most ``credit`` samples are ever held, whatever the
        pool's speed."""
        sock = self._connect()
        deadline = time.monotonic() + self.timeout_s
        if self._started is None:
            self._started = time.monotonic()
        self._waiting_since = time.monotonic()  # from here to the yield, the loop waits on us
        idle_since = time.monotonic()
        end: M.End | None = None
        while True:
            self._drain_released()  # the views the loop dropped: their RECEIVEDs before its acks
            if self.ack_mode == "use" and self._used:
                self.ack_all_used()
            self._flush()
            self._collect_deletes()
            # Every heartbeat_s, busy or not: it carries the wait share, not only liveness.
            if time.monotonic() - self._last_beat > self.heartbeat_s and not self._outbox:
                self._last_beat = time.monotonic()
                self._send(self._heartbeat())
            if self._pool.has_result():
                sample = self._settle(*self._pool.pop())
                self._send(M.Credit(n=1))
                if sample is None:
                    continue
                self._used.append(sample.key)
                self._used_set.add(sample.key)
                self.stats["yielded"] += 1
                self._waited += time.monotonic() - self._waiting_since
                self._waiting_since = None
                sample.timings["handed"] = time.time()
                yield sample
                del sample  # the loop's, not ours: a slot's RECEIVED waits for its views to go
                self._waiting_since = time.monotonic()
                idle_since = time.monotonic()
                continue
            if end is not None and not len(self._pool):  # what came before the END is yielded first
                self._waited, self._waiting_since = self.waited_s, None
                if end.reason != "complete":
                    raise StreamError(f"the sidecar at {self.endpoint} refused this stream: {end.reason}")
                return
            busy = len(self._pool) > 0
            take = end is None and not self._pool.full  # else only a worker's result can come
            poller = zmq.Poller()
            if take:
                poller.register(sock, zmq.POLLIN)
            if self._pool.fileno() >= 0:
                poller.register(self._pool.fileno(), zmq.POLLIN)
            if len(self._deletes) and self._deletes.fileno() >= 0:  # a RECEIVED to send once done
                poller.register(self._deletes.fileno(), zmq.POLLIN)
            t0 = time.perf_counter()
            events = dict(poller.poll(int(min(self.heartbeat_s, 0.5, self.idle_s or 0.5) * 1000)))
            self.stats["check_wait_s" if busy else "wait_s"] += time.perf_counter() - t0
            self._pool.clear_wakeups()
            self._deletes.clear_wakeups()  # its finished deletes are collected at the loop's top
            self._drain_released()
            if sock not in events:
                if busy:
                    continue  # a worker is on it: the sidecar's silence and our deadline wait
                if time.monotonic() - self._last_recv > self.sidecar_silence_s:
                    sock = self._reconnect()
                if time.monotonic() > deadline:
                    why = (" (nothing could be sent: no connection; for tcp:// check the CURVE keys)"
                           if self._outbox else " (is it running, and is the job producing?)")  # fmt: skip
                    if held := self.slots_held:
                        why += (f"; this loop still holds views of {held} arena slot(s): their bytes stay taken "
                                "until the tensors are dropped, and a full arena produces nothing more (copy "
                                "what you keep: sample.hidden_states.clone())")  # fmt: skip
                    raise StreamError(f"no sample from the sidecar at {self.endpoint} for {self.timeout_s:.0f} s{why}")
                if self.idle_s is not None and time.monotonic() - idle_since >= self.idle_s:
                    self._waited, self._waiting_since = self.waited_s, None  # the loop's own time
                    yield None  # type: ignore[misc]
                    self._waiting_since = idle_since = time.monotonic()
                continue
            # A burst: take what has arrived (up to the pool's bound) so the workers start at once.
            while end is None and not self._pool.full:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._last_recv = time.monotonic()
                msg = M.decode_msg(frames)
                if isinstance(msg, M.End):
                    end = msg
                elif isinstance(msg, M.Deliver):
                    deadline = time.monotonic() + self.timeout_s
                    self.stats["delivered"] += 1
                    self._submit(msg, M.payload_of(frames))
                    if self.workers == 0:
                        break  # checked inline already: hand it over before reading the next
                # else a heartbeat: the sidecar is alive, but it is no sample (timeout_s runs on)

    def _admit(self, d: M.Deliver) -> bool:
        """Whether a delivery is to be read; a duplicate is dropped here, on the socket's thread."""
        key = d.notice.key
        if key is None:
            return False
        if key in self._acked:  # redelivered after we acked: never yield twice
            self._acked.move_to_end(key)  # the sidecar has not seen our ack yet: keep it fresh
            self.stats["duplicates"] += 1
            self._drop_copy(d)
            self._send_acks([(key, d.token)])  # after the RECEIVED of a slot still in use
            return False
        self._tokens[key] = d.token  # the latest lease: the one our ack must name
        self.lease_s = d.lease_s
        if key in self._used_set:
            # Redelivered while we hold it unacked (our lease lapsed, e.g. a long checkpoint):
            # the loop already has this sample; its later ack settles this copy too.
            self.stats["duplicates"] += 1
            self._drop_copy(d)
            return False
        if key in self._held:
            # Redelivered while a worker still has it: that copy is yielded; this one's file is
            # freed unless it is the very file the worker reads (then that worker's settling does).
            self.stats["duplicates"] += 1
            if d.notice.file != self._held[key] or is_slot(d):
                self._drop_copy(d)
            return False
        return True

    def _fetch(self, d: M.Deliver, payload: bytes | memoryview | None) -> bytes | memoryview | None:
        assert self._receiver is not None
        if self._view_job is not None:  # the transport reuses one buffer: its reader must be done
            self._pool.wait_for(self._view_job)
            self._view_job = None
        try:
            return self._receiver.fetch(d, payload)
        except TransportError as e:
            # Not the sample's fault: stop with the reason; nothing is reported failed and the
            # lease goes back to the sidecar.
            raise StreamError(f"sample {d.notice.key}: {e} (no sample was reported failed)") from e

    def _submit(self, d: M.Deliver, payload: bytes | memoryview | None) -> None:
        if not self._admit(d):
            self._send(M.Credit(n=1))
            return
        received = time.time()
        data = self._fetch(d, payload)
        on_release = self._slots.hold(d) if is_slot(d) and data is None else None
        if self.pin_memory and not self.host_buffers.stats["warmed"]:
            # Before the first burst: one cached pinned block per sample the pool may hold.
            n = d.notice
            self.host_buffers.warm(n.nbytes + 8 * n.num_tokens + SF.HEADER_ALLOWANCE, self.credit + 1)
        job = self._pool.submit(d, self._load, d, data, received, on_release)
        self._held[d.notice.key] = d.notice.file  # type: ignore[index]
        if isinstance(data, memoryview):
            self._view_job = job

    def _load(self, d: M.Deliver, data: bytes | memoryview | None, received: float, on_release: Any = None) -> Sample:
        """Read and check one delivery (on a worker: touches no socket and no stream state;
        ``on_release`` tells when a slot's views are gone, see :meth:`SlotHolds.hold`)."""
        tm: dict[str, float] = {"received": received, "started": time.time()}
        reads_spool = self._receiver is not None and self._receiver.reads_spool
        spool = self.spool if reads_spool else None
        sample = load_and_check(spool, d, data, pin_memory=self.pin_memory, device=self.device,
                                alloc=self.host_buffers.alloc, timings=tm, readers=self._readers if reads_spool else None,
                                on_release=on_release, rescan_finite=self.options.rescan_finite,
                                verify_slots=self.options.verify_slots)  # fmt: skip
        decoded = sample.dequantized(self.dequantize)
        if decoded is not sample and tm.pop("in_slot", 0):
            # Decoded into new tensors: the slot's last views are the token ids; copied out, the
            # slot is released as soon as this returns.
            decoded.token_ids = decoded.token_ids.clone()
            tm["bytes_copied"] = tm.get("bytes_copied", 0) + decoded.token_ids.numel() * 8
        sample = decoded
        del decoded
        tm.pop("in_slot", None)
        tm["checked"] = time.time()
        sample.timings = tm
        return sample

    def _settle(self, d: M.Deliver, job: Future) -> Sample | None:
        """A finished job, on the socket's thread: the sample, or None after reporting it failed."""
        key = d.notice.key
        self._held.pop(key, None)  # type: ignore[arg-type]
        try:
            sample = job.result()
        except SlotNotReadable as e:  # before ValueError's handler: not the sample's fault
            self._slots.settle(d, False)
            self._not_received(d, e)
            return None
        except OSError as e:
            if not self._reads_a_marked_spool():
                # A wrong spool_dir: reporting the sample failed, or not received, would churn
                # every sample of the job. Stop at once; nothing is reported, and the lease goes
                # back to the sidecar.
                raise StreamError(
                    f"cannot read delivered file {d.notice.file!r} in spool_dir {self.spool}: {e.strerror or e}, "
                    f"and it is not a spool (no {SP.SPOOL_MARKER} marker). Is spool_dir the sidecar's "
                    "HSSTREAM_SPOOL_DIR on this host? (no sample was reported failed)"
                ) from e
            self._not_received(d, e)
            return None
        except (InvalidSample, M.ProtocolError, ValueError) as e:
            self._slots.settle(d, False)
            self._unread_run = 0
            self.stats["invalid"] += 1
            log.warning("sample %s rejected: %s", key, e)
            self._tokens.pop(key, None)  # type: ignore[arg-type]
            self._send(M.Fail(key=key, reason=str(e)[:500], token=d.token))  # type: ignore[arg-type]
            return None
        self._unread_run = 0
        tm = sample.timings
        if "started" in tm and "checked" in tm:
            self.stats["load_s"] += tm["checked"] - tm["started"]
        self.stats["bytes"] += d.notice.nbytes
        self.stats["bytes_copied"] += int(tm.get("bytes_copied", 0))
        if is_slot(d) and self._slots.settle(d, True, sample):  # its RECEIVED once no view of the slot is left
            return sample
        # The tensors are in memory (read or copied out of the file): the file can go now.
        self._drop_copy(d, aside=True)
        return sample

    def _reads_a_marked_spool(self) -> bool:
        """Whether this stream reads a spool, and ``spool_dir`` is one (a directory with the
        sidecar's marker): then a file missing from it is a race, not a misconfiguration."""
        if self._receiver is None or not self._receiver.reads_spool:
            return False
        try:
            return SP.is_marked_spool(self.spool)
        except OSError:  # e.g. another user's 0700 spool
            return False

    def _not_received(self, d: M.Deliver, e: Exception) -> None:
        """A delivered file is gone or unreadable in our spool (deleted by hand or by a clean-up,
        or a transient read error): the sample is fine, we just never had it. FAIL with
        ``not_received`` has the sidecar produce it again without spending an attempt. A long
        run of them means this spool is not the sidecar's (another stack's marked spool): every
        sample would go round forever, so the stream stops instead."""
        key = d.notice.key
        self.stats["not_received"] += 1
        self._unread_run += 1
        why = getattr(e, "strerror", None) or str(e)
        where = self._readers.of(d.notice).where(d.notice)
        log.warning("sample %s not received: cannot read %s in %s (%s); the sidecar produces it again",
                    key, where, self.spool, why)  # fmt: skip
        self._tokens.pop(key, None)  # type: ignore[arg-type]
        self._send(M.Fail(key=key, reason=f"not received: {why}"[:500], not_received=True,  # type: ignore[arg-type]
                          token=d.token))
        if self._unread_run >= max(16, 2 * self.credit):
            raise StreamError(
                f"{self._unread_run} delivered files in a row could not be read in spool_dir {self.spool} "
                f"(last: {where!r}: {why}). Is spool_dir the spool of the sidecar at {self.endpoint}?"
            ) from e

    def _collect_deletes(self, wait_for: Iterable[M.SampleKey] = (), *, every: bool = False) -> None:
        """Take back the deleter's finished jobs and send their RECEIVEDs (what failed is the
        reaper's: the file has a temporary name of ours). ``wait_for``: keys whose deletes are
        waited for first (their RECEIVED must precede their ACK); ``every``: all deletes."""
        if wait_for or every:
            futures.wait([f for d, f in self._deletes.held() if every or d.notice.key in wait_for])
        while self._deletes.has_result():
            d, job = self._deletes.pop()
            try:
                job.result()
            except OSError as e:
                log.warning("could not delete %s's retired copy from the spool: %s", d.notice.file, e)
            if d.notice.key is not None and self._sock is not None:
                self._send(M.Received(keys=[d.notice.key], tokens=[d.token]))

    def _take(self, d: M.Deliver, payload: bytes | None = None) -> Sample | None:
        """One delivery admitted, read, checked and settled on this thread (no pool)."""
        if not self._admit(d):
            return None
        data = self._fetch(d, payload)
        on_release = self._slots.hold(d) if is_slot(d) and data is None else None
        job: Future = Future()
        try:
            job.set_result(self._load(d, data, time.time(), on_release))
        except Exception as e:  # noqa: BLE001 - settled below exactly as a worker's result
            job.set_exception(e)
        return self._settle(d, job)

    def _drop_copy(self, d: M.Deliver, *, aside: bool = False) -> None:
        """Free the delivered file (ours to delete when we read the spool; else the sidecar
        deletes its own on RECEIVED) and tell the sidecar its spool bytes are free. ``aside``:
        renamed out of the spool now (for the sidecar, as if deleted), its bytes freed by the
        deleter thread, unless that has no thread or is full. An arena slot is never touched:
        a copy delivered again while the first one's slot is in use has its RECEIVED go with
        that one's (the sidecar frees the slot on either)."""
        if is_slot(d):
            if self._slots.add_copy(d):
                return
            if d.notice.key is not None:
                self._send(M.Received(keys=[d.notice.key], tokens=[d.token]))
            return
        if self._receiver is not None and self._receiver.reads_spool:
            if aside and self._deletes.workers and not self._deletes.full:
                if (retired := SP.retire_from_spool(self.spool, d.notice.file)) is not None:
                    self._deletes.submit(d, _unlink, retired)
                    return  # its RECEIVED goes once the bytes are freed (_collect_deletes)
            else:
                SP.remove_from_spool(self.spool, d.notice.file)
        if d.notice.key is not None:
            self._send(M.Received(keys=[d.notice.key], tokens=[d.token]))

    def keepalive(self) -> None:
        """Tell the sidecar we are alive during long pauses between samples (a checkpoint, an
        evaluation); call it from the thread that iterates. Leases lapse after the sidecar's
        HSSTREAM_TRAINER_TIMEOUT_S of silence and the samples are produced again."""
        if self._sock is not None:
            self._flush()
            self._last_beat = time.monotonic()
            self._send(self._heartbeat())

    def close(self, *, failed: bool = False) -> None:
        """Return leases and send pending acks. With ``ack="use"`` the sample yielded last is
        not acked: the loop never asked past it (it broke out, or stopped on an error:
        ``failed``), so it may not have been used, and it comes back; a sample trained twice
        is harmless, one acked unused is lost.

        Samples the pool still holds (delivered, not yet yielded) are finished first and settled
        as usual — an invalid one reported failed, a read one's file removed and RECEIVED sent —
        but not yielded or acked, so the sidecar produces them again; then the workers stop."""
        unread: list[str] = []
        for d, job in self._pool.close():
            self._held.pop(d.notice.key, None)  # type: ignore[arg-type]
            if self._sock is None:
                continue
            try:
                self._settle(d, job)
            except StreamError as e:  # the error the loop saw (or will not see now): the lease goes back
                unread.append(str(e))
        d = job = None  # type: ignore[assignment]  # the last one's sample (a slot's views) goes now
        if unread:
            log.warning("closing: %d delivered sample(s) not read, their leases go back: %s", len(unread), unread[0])
        self._view_job = None
        if self._sock is not None:
            self._collect_deletes(every=True)  # every RECEIVED before the acks
            self._drain_released()  # the slots of samples dropped (those settled just now too)
            self._slots.copy_out_yielded()  # e.g. the last sample of a `for x in stream` loop, still in x
            self._drain_released()
            if (held := self.slots_held):
                log.info("closing: %d arena slot(s) still viewed by live tensors: no RECEIVED for them (the "
                         "sidecar takes them back when it drops this trainer)", held)  # fmt: skip
            if self.ack_mode == "use":
                if self._used:
                    self._used_set.discard(self._used.pop())
                self.ack_all_used()
            t0 = time.monotonic()  # give queued acks a moment to go; unacked samples come back anyway
            while self._outbox and time.monotonic() - t0 < 2.0:
                self._flush()
                time.sleep(0.01)
            self._sock.close(linger=0 if self._outbox else 2000)
            self._sock = None
        self._deletes.close()  # the retired copies' deletes finish first
        self._readers.close()  # an arena's mapping itself stays while views of it live
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def __enter__(self) -> HiddenStateStream:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)
