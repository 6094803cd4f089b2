"""Writer threads and the notice socket: everything the connector does after the copy.

Runs inside vLLM's worker process (TP rank 0) but never on the engine's step: the step only
enqueues. Files are written under a hidden temporary name and renamed into place, so a
reader never sees a half-written file; the notice is sent only after the rename. One thread
owns the PUSH socket (ZeroMQ sockets are not thread-safe); writers hand it notices through a
queue. The connector connects, the sidecar binds: engines can come and go freely.

A sample whose tag carries a :class:`~connector.contract.arena.Slot` (the arena layout) is
written into that slot of the spool's one arena file instead (:meth:`SpoolWriter._write_slot`):
its header length zeroed first, its tensors copied into their spans (the hidden states usually
gathered there directly by the worker, ``worker_side.py``), the checksum taken over the slot's
own bytes, the header written last, then the notice (``file`` None, ``slot`` set). Nothing is
ever written outside the slot.

``stats["bytes_copied"]`` counts the bytes each sample costs in copies on this host, counted at
the copies themselves (the benchmark compares the layouts by it): the gather into host memory
(CPU ``index_select``, or the device-to-host copy; a gather straight into a slot is that one
copy), the encode when it makes new tensors (FP8: the quantised values and scales it returns),
and the write (the file's bytes, header included, as safetensors writes them from the
tensors' memory; or every tensor and the header copied into a slot).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq
from safetensors.torch import save_file

from connector.contract import arena as A
from connector.contract import messages as M, sample_file as SF, spool as SP
from connector.contract import payload as PL
from connector.contract.spool import WriteLock

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
    arena: MappedArena | None = None  # the mapping the slot is in (None: the writer's current one)
    #: The writer's hold on the slot (taken by the gatherer before it copies into it; released
    #: once the header is written or the write failed).
    lease: A.SlotLease | None = None
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


class MappedArena:
    """This process's mapping of one arena (one per arena id), as a uint8 tensor the slots'
    tensors are views of. Kept alive by the writes still using it: an arena replaced by the
    sidecar stays mapped (and, on CUDA, registered) until its last write is done."""

    def __init__(self, arena: A.Arena) -> None:
        self.arena = arena
        self.id = arena.id
        self.bytes = torch.frombuffer(arena.map, dtype=torch.uint8)
        self.cuda_registered = False
        self._reg_lock = threading.Lock()

    def register_cuda(self) -> bool:
        """Page-lock the whole mapping for the device once (``cudaHostRegister``), so a gather's
        device-to-host copy lands in the slot as one non-blocking DMA. False if the driver
        refuses (the caller copies through a pinned buffer instead)."""
        with self._reg_lock:
            if not self.cuda_registered:
                cudart = torch.cuda.cudart()
                ptr = self.bytes.data_ptr()
                err = cudart.cudaHostRegister(ptr, self.arena.size, 0)
                if int(getattr(err, "value", err)) != 0:
                    A.clear_cuda_error()  # else the failure stays the thread's error, and the next launch raises it
                    log.warning("cudaHostRegister of the arena (%d bytes) failed (%s): slots are written "
                                "through a pinned buffer", self.arena.size, err)  # fmt: skip
                    return False
                self.cuda_registered = True
                # Unregistered when the mapping goes (after the last write that used it).
                weakref.finalize(self, cudart.cudaHostUnregister, ptr)
            return True

    def lease(self, slot: A.Slot) -> A.SlotLease:
        """The hold on ``slot`` before any byte of it is written (``Arena.lease``: locked, its
        claim checked, the header length zero until the header is written last). Raises
        :class:`~connector.contract.arena.SlotReassigned` for a slot given up since."""
        return self.arena.lease(slot)

    def tensor(self, slot: A.Slot, span: tuple[int, int], dtype: torch.dtype,
               shape: tuple[int, ...] | list[int]) -> torch.Tensor:  # fmt: skip
        """The slot's data bytes ``span`` (relative to the data's start) as a tensor; refuses a
        span past the slot's end."""
        a, b = slot.offset + A.SLOT_HEADER + span[0], slot.offset + A.SLOT_HEADER + span[1]
        if b > slot.end or a > b:
            raise A.ArenaError(f"span {span} past the slot's {slot.length - A.SLOT_HEADER} data bytes")
        return self.bytes[a:b].view(dtype).view(tuple(shape))

    def write_header(self, slot: A.Slot, header: bytes) -> None:
        """The header, its length last (the slot is complete from then on)."""
        if len(header) != A.SLOT_HEADER:
            raise A.ArenaError(f"slot header of {len(header)} bytes, a slot's is {A.SLOT_HEADER}")
        self.arena.map[slot.offset + 8 : slot.offset + A.SLOT_HEADER] = header[8:]
        self.arena.map[slot.offset : slot.offset + 8] = header[:8]


class SlotTooSmall(A.ArenaError):
    """The sample does not fit the slot it was given (the sidecar priced it for fewer bytes)."""


#: safetensors' dtype names of the torch dtypes a sample's tensors have.
def _st_name(dtype: torch.dtype) -> str:
    for name in PL.safetensors_itemsizes():
        if PL.safetensors_torch_dtype(name) == dtype:
            return name
    raise A.ArenaError(f"{dtype} cannot be laid out in a slot")


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
        self._arena: MappedArena | None = None  # the arena layout's mapping, opened at its first slot
        self._arena_lock = threading.Lock()
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

    # -- the arena layout --------------------------------------------------------------------
    def arena_for(self, slot: A.Slot) -> MappedArena:
        """The mapping ``slot`` is in: the arena is opened once per process and again when a slot
        names another arena or the file was replaced (the sidecar made a new one). Raises
        :class:`~connector.contract.arena.ArenaError` ("arena changed") if the spool's arena is
        still not the slot's, or the slot lies past its end."""
        with self._arena_lock:
            m = self._arena
            if m is None or slot.arena != m.id or not m.arena.is_current():
                arena = A.Arena.open(self.spool)
                if m is not None:
                    # Its fd only: torch.frombuffer holds the mmap object but no buffer export, so
                    # closing the map would unmap it under writes still in flight. It is unmapped
                    # when the last of them lets go of it.
                    os.close(m.arena._fd)
                self._arena = m = MappedArena(arena)
            if slot.arena != m.id:
                raise A.ArenaError(f"arena changed: the slot is in arena {slot.arena}, the spool's is {m.id}")
            m.arena.check(slot)
            m.arena.prefault_ahead(slot)  # in the background: the next slots' first writes pay no faults
            return m

    def slot_bytes_for(self, num_tokens: int) -> int:
        """Bytes a sample of ``num_tokens`` takes in a slot (header room, payload, token ids)."""
        c = PL.codec(self.shape.dtype)
        per_token = c.bytes_per_position(len(self.shape.layer_ids), self.shape.hidden_size) + 8
        return A.SLOT_HEADER + num_tokens * per_token

    # -- called from the engine's step: must return at once ---------------------------------
    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may wait for a writer (one write always may)."""
        with self._lock:
            return self._pending == 0 or self._pending_bytes + nbytes <= self.max_pending_bytes

    def refuse_busy(self, request_id: str, tag: M.RequestTag | None) -> None:
        with self._lock:
            self.stats["busy"] += 1
            mb = self._pending_bytes / 2**20
        self._publish(self._notice(request_id, tag, status=M.NoticeStatus.busy,
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
        self._publish(self._notice(request_id, tag, status=M.NoticeStatus.error, reason=reason))

    # -- writer threads ----------------------------------------------------------------------
    def _notice(self, request_id: str, tag: M.RequestTag | None, **kw: object) -> M.Notice:
        s = self.shape
        if tag is not None and tag.slot is not None:
            kw.setdefault("slot", tag.slot)  # every notice of a slot sample names it (ok, error, busy)
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
        if job.tag is not None and job.tag.slot is not None and job.path is None:
            self._write_slot(job, job.tag.slot)
            return
        dest = job.path or self.spool / job.file
        tmp = dest.parent / SP.tmp_name_for(dest.name)
        t0 = time.perf_counter()
        try:
            if job.ready is not None:
                job.ready()
            t1 = time.perf_counter()
            ids = torch.tensor(job.token_ids, dtype=torch.int64)
            # Encoded on the writer thread, off the engine's step (as hs-connectors quantises on
            # write), unless the gatherer encoded on the device (FP8: half the bytes copied).
            payload = job.encoded if job.encoded is not None else self.encode(job.hidden_states)
            if (rows := payload[SF.HIDDEN_STATES_KEY].shape[0]) != ids.shape[0]:
                raise ValueError(f"{rows} hidden-state rows for {ids.shape[0]} tokens")
            tensors = {**payload, SF.TOKEN_IDS_KEY: ids}
            digest, finite = SF.checksum_and_finite(tensors, algo=self.checksum_algo, threads=self.checksum_threads)
            t2 = time.perf_counter()
            notice = self._notice(
                job.request_id,
                job.tag,
                status=M.NoticeStatus.ok,
                file=job.file if job.path is None else None,  # the sidecar reads the spool only
                num_tokens=int(ids.shape[0]),
                nbytes=sum(t.numel() * t.element_size() for k, t in tensors.items() if k != SF.TOKEN_IDS_KEY),
                checksum=digest,
                checksum_algo=self.checksum_algo,
                finite=finite,
            )
            save_file(
                tensors,
                str(tmp),
                metadata=SF.header_metadata(notice),
            )
            # Token ids are the users' prompts: 0600 before the name is visible. safetensors 0.8
            # writes 0600 itself; older releases (GPU images pin their own) follow the umask.
            self.count_copied(os.stat(tmp).st_size)  # the file's bytes, as safetensors wrote them
            os.chmod(tmp, SP.FILE_MODE)
            os.rename(tmp, dest)
            if job.lock is not None:
                job.lock.release()
            t3 = time.perf_counter()
            timings = {"gather": job.gather_s, "queue": t0 - job.created, "copy_wait": t1 - t0, "checksum": t2 - t1,
                       "write": t3 - t2}
            notice = notice.model_copy(update={"timings": {k: round(v, 6) for k, v in timings.items()}})
        except BaseException as e:  # noqa: BLE001 - every failure must become a notice
            log.exception("hidden-state write failed for %s", job.request_id)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            notice = self._notice(job.request_id, job.tag, status=M.NoticeStatus.error, reason=f"write failed: {e!r}")
        finally:
            job.hidden_states = job.encoded = None  # release pinned memory now
            if job.lock is not None:
                job.lock.abandon()  # no-op once released; else no file will come
        self._publish(notice)
        with self._lock:
            self._pending -= 1
            self._pending_bytes -= job.nbytes
            self._idle.notify_all()

    def encode(self, hs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The payload codec's tensors for ``hs``, the bytes of those it made anew counted (FP8's
        values and scales; a model-dtype payload is ``hs`` itself)."""
        out = PL.codec(self.shape.dtype).encode(hs)
        src = hs.untyped_storage().data_ptr()
        made = sum(t.numel() * t.element_size() for t in out.values() if t.untyped_storage().data_ptr() != src)
        if made:
            self.count_copied(made)
        return out

    def _write_slot(self, job: WriteJob, slot: A.Slot) -> None:
        """The arena layout's write (module docstring): into ``slot``, never past its end."""
        t0 = time.perf_counter()
        try:
            if job.ready is not None:
                job.ready()
            t1 = time.perf_counter()
            mapped = job.arena or self.arena_for(slot)
            if job.lease is None:  # the gatherer took it before copying into the slot, or not in place
                job.lease = mapped.lease(slot)
            hs = job.hidden_states
            ids = torch.tensor(job.token_ids, dtype=torch.int64)
            if job.encoded is not None:  # encoded on the device: copied into the slot below
                payload = job.encoded
            else:
                payload = {SF.HIDDEN_STATES_KEY: hs} if job.in_slot else self.encode(hs)
            if (rows := payload[SF.HIDDEN_STATES_KEY].shape[0]) != ids.shape[0]:
                raise ValueError(f"{rows} hidden-state rows for {ids.shape[0]} tokens")
            tensors = {**payload, SF.TOKEN_IDS_KEY: ids}
            specs = [(k, _st_name(t.dtype), list(t.shape), t.numel() * t.element_size()) for k, t in tensors.items()]
            need = A.SLOT_HEADER + sum(sp[3] for sp in specs)
            if need > slot.length:
                raise SlotTooSmall(f"sample of {need} bytes does not fit its slot of {slot.length}")
            spans = A.data_spans(specs)
            views = {k: mapped.tensor(slot, spans[k], t.dtype, t.shape) for k, t in tensors.items()}
            for k, v in views.items():
                if job.in_slot and k == SF.HIDDEN_STATES_KEY:
                    if v.data_ptr() != hs.data_ptr():
                        raise A.ArenaError("hidden states gathered outside their span of the slot")
                    continue
                v.copy_(tensors[k])
                self.count_copied(v.numel() * v.element_size())
            # Over the slot's own bytes, the finiteness scan in the same pass.
            digest, finite = SF.checksum_and_finite(views, algo=self.checksum_algo, threads=self.checksum_threads)
            t2 = time.perf_counter()
            notice = self._notice(
                job.request_id,
                job.tag,
                status=M.NoticeStatus.ok,
                file=None,
                slot=slot,
                num_tokens=int(ids.shape[0]),
                nbytes=sum(sp[3] for sp in specs if sp[0] != SF.TOKEN_IDS_KEY),
                checksum=digest,
                checksum_algo=self.checksum_algo,
                finite=finite,
            )
            header, _ = A.header_for(specs, SF.header_metadata(notice))
            mapped.write_header(slot, header)
            self.count_copied(len(header))
            t3 = time.perf_counter()
            timings = {"gather": job.gather_s, "queue": t0 - job.created, "copy_wait": t1 - t0, "checksum": t2 - t1,
                       "write": t3 - t2}
            notice = notice.model_copy(update={"timings": {k: round(v, 6) for k, v in timings.items()}})
        except BaseException as e:  # noqa: BLE001 - every failure must become a notice
            log.exception("hidden-state write into slot %s+%s failed for %s", slot.offset, slot.length, job.request_id)
            notice = self._notice(job.request_id, job.tag, status=M.NoticeStatus.error, reason=f"write failed: {e!r}")
        finally:
            job.hidden_states = None  # type: ignore[assignment]
            job.arena = None
            if job.lease is not None:
                job.lease.release()  # after the header: the sidecar may void the slot from here
                job.lease = None
            if job.lock is not None:
                job.lock.abandon()
        self._publish(notice)
        with self._lock:
            self._pending -= 1
            self._pending_bytes -= job.nbytes
            self._idle.notify_all()

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
