"""Writer threads and the notice socket: everything the connector does after the copy.

Runs inside vLLM's worker process (TP rank 0) but never on the engine's step: the step only
enqueues. Where a sample's copy lands and how it is committed is its spool layout's
(``connector/layouts/``: a file renamed into place, or a slot whose header is written last),
chosen by the sample's tag (:meth:`SpoolWriter._write`); either way the notice is sent only
once the sample is complete. One thread owns the PUSH socket (ZeroMQ sockets are not
thread-safe); writers hand it notices through a queue. The connector connects, the sidecar
binds: engines can come and go freely.

``stats["bytes_copied"]`` counts the bytes each sample costs in copies on this host, counted at
the copies themselves (the benchmark compares the layouts by it): the gather into host memory
(CPU ``index_select``, or the device-to-host copy; a gather straight into a slot is that one
copy), the encode when it makes new tensors (FP8: the quantised values and scales it returns),
and the write (the file's bytes, header included, as safetensors writes them from the
tensors' memory; or every tensor and the header copied into a slot).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from connector.contract import messages as M, sample_file as SF
from connector.contract import payload as PL
from connector.contract.spool import WriteLock
from connector import layouts as L

log = logging.getLogger("hsstream.connector")


@dataclass
class WriteJob:
    request_id: str
    file: str
    tag: M.RequestTag | None
    token_ids: list[int]
    hidden_states: torch.Tensor | None  # host tensor [T, K, H]; may still be filling (see ready); None: encoded
    ready: Callable[[], None] | None = None  # blocks until the async copy has landed
    nbytes: int = 0  # counted against the writer's bound while it waits
    path: Path | None = None  # a client's own path (allow_custom_save_path); None: spool / file
    lock: WriteLock | None = None  # the companion lock a plain client waits on, held until done
    gather_s: float = 0.0  # time the engine's step spent enqueuing this sample's gather
    # The payload codec's tensors, already encoded where the rows were (the gatherer, on the GPU
    # before the copy: PayloadCodec.encode_on_device); the writer then does not encode.
    encoded: dict[str, torch.Tensor] | None = None
    #: Arena layout: ``hidden_states`` is already the slot's own span (gathered into it), only
    #: the token ids and the header are left to write; else the writer copies it in.
    in_slot: bool = False
    arena: Any = None  # the arena layout's mapping the slot is in (None: the writer's current one)
    #: The writer's hold on the slot (taken by the gatherer before it copies into it; released
    #: once the header is written or the write failed).
    lease: Any = None
    #: When the engine's step handed the job over (``time.perf_counter``): the notice's ``queue``
    #: timing is the wait from here to a writer thread, so its stages add up from the step on.
    created: float = field(default_factory=time.perf_counter)

    def host_bytes(self) -> int:
        """Host memory this job holds while it waits (hidden states already in their slot: none
        beyond the arena's)."""
        if self.in_slot:
            return 0
        ts = self.encoded.values() if self.encoded is not None else [self.hidden_states]
        return sum(t.numel() * t.element_size() for t in ts)


def spool_full(e: BaseException) -> bool:
    """A write the spool's filesystem refused for room (``ENOSPC``, a quota), anywhere in the chain
    (safetensors raises its own error around the OS's)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "os error 28" in str(e):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
        seen += 1
    return False


@dataclass(frozen=True)
class ShapeInfo:
    """What every notice repeats about the verifier, so a trainer can check before loading."""

    layer_ids: list[int]
    num_hidden_layers: int
    hidden_size: int
    dtype: str  # the stored dtype, a payload codec's (connector/contract/payload.py)
    model: str


class SpoolWriter:
    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        notice_endpoint: str | None,
        shape: ShapeInfo,
        num_threads: int = 4,
        *,
        max_pending_bytes: int = 2 * 2**30,
        max_queued_notices: int = 4096,
        checksum_algo: str = SF.CHECKSUM_ALGO,
        checksum_threads: int = 1,
        max_sender_restarts: int = 5,
    ) -> None:
        """Both queues are bounded, and neither bound ever blocks the engine step: over
        ``max_pending_bytes`` of hidden states waiting for a writer, a request gets a "busy"
        notice (the sidecar submits it again later); over ``max_queued_notices`` waiting for a
        sidecar (none connected), notices are dropped and counted — the sidecar's notice
        timeout resubmits those samples, and its reaper removes their files.

        The notice thread is supervised (``_sender_main``): an exception in it is logged and the
        thread's loop started again on a new socket, up to ``max_sender_restarts`` times in a
        row (a minute without failure starts the count again). Past that it stops for good,
        says so at CRITICAL, and counts ``notice_thread_dead``; the sidecar's ``/readyz`` then
        reports that notices stopped (its samples time out and none arrives after).

        ``checksum_algo`` and ``checksum_threads`` (blake3's threads per sample, 0: all cores)
        are the connector's ``HSSTREAM_CHECKSUM`` / ``HSSTREAM_CHECKSUM_THREADS``: one thread
        by default, since the writers share vLLM's cores (``sample_file.CONNECTOR_CHECKSUM_ALGO``)."""
        self.spool = Path(spool_dir)
        self.checksum_algo = checksum_algo
        self.checksum_threads = checksum_threads
        self.shape = shape
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="hsstream-write")
        self._notices: queue.Queue[bytes | None] = queue.Queue(maxsize=max(1, max_queued_notices))
        self.max_queued_notices = max(1, max_queued_notices)
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        #: ``bytes_copied``: see the module docstring (the copies' own sizes, summed as they happen).
        self.stats = {"busy": 0, "notices_dropped": 0, "notice_thread_restarts": 0, "notice_thread_dead": 0,
                      "bytes_copied": 0}  # fmt: skip
        #: The spool layouts' writer halves (``connector/layouts/``), built at each one's first sample.
        self.layouts = L.Writers(self.spool)
        self.max_sender_restarts = max_sender_restarts
        self._endpoint = notice_endpoint
        self._sender: threading.Thread | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        if notice_endpoint:
            self._sender = threading.Thread(target=self._sender_main, name="hsstream-notice", daemon=True)
            self._sender.start()

    def count_copied(self, nbytes: int) -> None:
        """Add a copy's bytes to ``stats["bytes_copied"]`` (any thread)."""
        with self._lock:
            self.stats["bytes_copied"] += int(nbytes)

    def stats_snapshot(self) -> dict[str, int]:
        """A copy of :attr:`stats` taken under the writer's lock: counters from one moment, for
        a reader on another thread (a benchmark's before and after)."""
        with self._lock:
            return dict(self.stats)

    # -- called from the engine's step: must return at once ---------------------------------
    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may wait for a writer (one write always may)."""
        with self._lock:
            return self._pending == 0 or self._pending_bytes + nbytes <= self.max_pending_bytes

    def refuse_busy(self, request_id: str, tag: M.RequestTag | None) -> None:
        with self._lock:
            self.stats["busy"] += 1
            mb = self._pending_bytes / 2**20
        self._publish(self.notice(request_id, tag, status=M.NoticeStatus.busy,
                                   reason=f"connector busy: {mb:.0f} MiB of hidden states waiting to be written "
                                          f"(HSSTREAM_MAX_PENDING_WRITE_BYTES)"))  # fmt: skip

    def submit(self, job: WriteJob) -> bool:
        """Queue a write, or refuse it with a "busy" notice when the queue is full."""
        nbytes = job.host_bytes()
        if not self.has_room(nbytes):
            self._drop_lease(job)
            self.refuse_busy(job.request_id, job.tag)
            return False
        with self._lock:
            self._pending += 1
            self._pending_bytes += nbytes
        job.nbytes = nbytes
        try:
            self._pool.submit(self._write, job)
        except BaseException:
            with self._lock:
                self._pending -= 1
                self._pending_bytes -= nbytes
            self._drop_lease(job)
            raise
        return True

    @staticmethod
    def _drop_lease(job: WriteJob) -> None:
        """Let go of a job's slot that will not be written: once a copy still landing in it is in
        (the sidecar may give the slot to another sample as soon as the lease is gone)."""
        if job.lease is None:
            return
        try:
            if job.ready is not None:
                job.ready()
        finally:
            job.lease.release()
            job.lease = None

    def submit_error(self, request_id: str, tag: M.RequestTag | None, reason: str) -> None:
        self._publish(self.notice(request_id, tag, status=M.NoticeStatus.error, reason=reason))

    # -- writer threads ----------------------------------------------------------------------
    def notice(self, request_id: str, tag: M.RequestTag | None, **kw: object) -> M.Notice:
        """A notice of this writer's shape for ``tag``'s sample (a layout's ``write`` makes its
        own with it), naming the sample's placement as its layout says."""
        s = self.shape
        for k, v in self.layouts.of(tag).notice_fields(tag).items():
            kw.setdefault(k, v)  # every notice of a sample names its placement (ok, error, busy)
        return M.Notice(
            request_id=request_id,
            key=tag.key if tag else None,
            attempt=tag.attempt if tag else 0,
            layer_ids=s.layer_ids,
            num_hidden_layers=s.num_hidden_layers,
            hidden_size=s.hidden_size,
            dtype=s.dtype,
            model=s.model,
            **kw,  # type: ignore[arg-type]
        )

    def _write(self, job: WriteJob) -> None:
        """A writer thread's job: the copy and its commit by the sample's layout (a client's own
        path is always a file), then its notice."""
        half = self.layouts.of(job.tag, job.file) if job.path is None else self.layouts.get(L.DEFAULT)
        notice = half.write(self, job)
        self._publish(notice)
        with self._lock:
            self._pending -= 1
            self._pending_bytes -= job.nbytes
            self._idle.notify_all()

    def count_spool_full(self) -> None:
        """A write the spool's filesystem refused for room: counted "busy" (and ``spool_full``)."""
        with self._lock:
            self.stats["busy"] += 1
            self.stats["spool_full"] = self.stats.get("spool_full", 0) + 1

    def encode(self, hs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The payload codec's tensors for ``hs``, the bytes of those it made anew counted (FP8's
        values and scales; a model-dtype payload is ``hs`` itself)."""
        out = PL.codec(self.shape.dtype).encode(hs)
        src = hs.untyped_storage().data_ptr()
        made = sum(t.numel() * t.element_size() for t in out.values() if t.untyped_storage().data_ptr() != src)
        if made:
            self.count_copied(made)
        return out

    def _publish(self, notice: M.Notice) -> None:
        if self._sender is None:
            return
        try:
            self._notices.put_nowait(notice.model_copy(update={"sent_at": time.time()}).encode())
        except queue.Full:
            with self._lock:
                self.stats["notices_dropped"] += 1
                n = self.stats["notices_dropped"]
            if n == 1 or n % 1000 == 0:
                log.warning("%d notice(s) dropped: %d waiting and no sidecar taking them (is it running at %s?)",
                            n, self.max_queued_notices, self._endpoint)  # fmt: skip

    # -- the socket's owner thread -----------------------------------------------------------
    def _sender_main(self) -> None:
        """Run the send loop; restart it after an exception, a bounded number of times.

        A dead notice thread would otherwise be silent: files keep appearing, no notice leaves,
        and every sample waits for its notice timeout, forever. The notice being sent when the
        loop failed is dropped (it may be what broke it); the sidecar's notice timeout resubmits
        that sample."""
        failures, last_failure = 0, 0.0
        while True:
            try:
                self._send_loop()
                return
            except Exception:  # noqa: BLE001 - any failure: logged, then restart or give up loudly
                now = time.monotonic()
                if now - last_failure > 60.0:
                    failures = 0
                failures, last_failure = failures + 1, now
                with self._lock:
                    self.stats["notices_dropped"] += 1
                if failures > self.max_sender_restarts:
                    self.stats["notice_thread_dead"] = 1
                    log.critical(
                        "the notice thread failed %d times in a row: it stays down, so no notice leaves this "
                        "engine (the sidecar's samples time out and its /readyz reports it); restart vLLM",
                        failures, exc_info=True,
                    )  # fmt: skip
                    return
                self.stats["notice_thread_restarts"] += 1
                log.exception("the notice thread failed: restarting it (%d/%d)", failures, self.max_sender_restarts)
                time.sleep(min(2.0, 0.05 * 2**failures))

    def _send_loop(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.setsockopt(zmq.SNDHWM, self.max_queued_notices)
        sock.connect(self._endpoint)
        try:
            while True:
                msg = self._notices.get()
                if msg is None:
                    break
                while not sock.poll(200, zmq.POLLOUT):  # no sidecar: wait, but not past close()
                    if self._closing:
                        return
                sock.send(msg)
        finally:
            sock.close()

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._sender is not None:
            try:
                self._notices.put_nowait(None)  # after what is queued: it still goes out
            except queue.Full:
                self._closing = True  # no sidecar has been taking notices: do not wait for one
            self._sender.join(timeout=10)
            self._closing = True
            self._sender.join(timeout=1)
