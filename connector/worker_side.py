"""The code that runs inside vLLM's worker, on the engine's step.

Its one rule: the forward never waits. On CUDA the rows are gathered on a side stream that
waits (on the device, not the host) for the work queued before this step's forward (an event
recorded when the step's metadata is bound, :meth:`HiddenStateGatherer.step_starts`), copied
into pinned host memory without blocking, and a writer thread waits for the copy's event.
The saves of a step are known only after its forward has been launched; waiting for the
whole stream then would hold every copy back by one more forward (tens of milliseconds with
2k-token batches on an H200: docs/benchmarks.md). When the payload codec encodes on the device
(``PayloadCodec.encode_on_device``: FP8), each chunk is encoded on that side stream before its
copy, so the copy moves the encoded bytes (FP8: half of bf16's) and the writer does not encode.
On the CPU backend the gather is a plain copy (the forward has already finished when the
connector runs) and the writer thread encodes, off the engine's step. Blocks stay allocated
(vLLM's delayed free) until the copy has landed; ``poll`` reports them.

A sample's spool layout (``connector/layouts/``) may gather its rows straight into its
placement (``WriterHalf.gather``): the arena's does, into the sample's slot of the mapped arena,
when its payload is the cache's own dtype (on CPU one ``index_select`` into the slot's span, on
CUDA the device-to-host copy into the mapping, page-locked once per process); an encoded payload
(FP8) is gathered (and on CUDA encoded) into host memory as for a file and copied into the slot
by the writer. A placement that cannot take the sample gets an error notice before any copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from connector.cache_layout import block_chunks, gather_rows, gather_rows_into, token_major_view
from connector.contract import payload as PL
from connector.contract.sample_file import HIDDEN_STATES_KEY
from connector.contract.spool import LockError, WriteLock
from connector.spool_writer import SpoolWriter, WriteJob
from connector.step_metadata import LockRequest, PendingSave

log = logging.getLogger("hsstream.connector")


@dataclass
class InFlight:
    event: torch.cuda.Event | None
    keep: list = field(default_factory=list)


class HiddenStateGatherer:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_size: int,
        num_layers: int,
        perm: list[int] | None,
        writer: SpoolWriter,
        chunk_tokens: int = 8192,
        encode_at_gather: bool | None = None,
    ) -> None:
        """``encode_at_gather``: encode here, chunk by chunk, rather than on the writer thread,
        when the codec allows it (``encode_on_device``); None: on CUDA only. On CPU there are no
        device-to-host bytes to save, and encoding here would run on the engine's step."""
        self.view = token_major_view(kv_cache, block_size, num_layers)
        self.block_size = block_size
        self.writer = writer
        self.chunk_tokens = chunk_tokens
        self.device = kv_cache.device
        self.cuda = kv_cache.is_cuda
        self.codec = PL.codec(writer.shape.dtype)
        want = self.cuda if encode_at_gather is None else encode_at_gather
        self.encode_at_gather = want and self.codec.encode_on_device
        self.perm = torch.tensor(perm, dtype=torch.long, device=self.device) if perm else None
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._inflight: dict[str, InFlight] = {}
        self._step_start: torch.cuda.Event | None = None  # the work queued before this step's forward

    def step_starts(self) -> None:
        """A step begins (its forward is not launched yet): mark what the GPU has queued so far,
        which includes the forward that wrote the states of the requests saved this step."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._step_start = ev

    def nbytes_for(self, num_tokens: int) -> int:
        """Host bytes a copy of ``num_tokens`` rows takes (what the writer's bound counts)."""
        k, h = self.view.shape[2], self.view.shape[3]
        if self.encode_at_gather:
            return num_tokens * self.codec.bytes_per_position(k, h)
        return num_tokens * k * h * self.view.element_size()

    def in_place(self, p: PendingSave) -> bool:
        """Whether ``p``'s rows go straight into their placement (its layout's gather: no host
        memory of the writer's)."""
        tag = p.request_tag() if p.tag and p.path is None else None
        return tag is not None and self.writer.layouts.of(tag, p.file).copies_in_place(self, p)

    def submit(self, p: PendingSave, lock: WriteLock | None = None) -> None:
        tag = p.request_tag()
        dest = Path(p.path) if p.path else None
        n = len(p.token_ids)
        k, h = self.view.shape[2], self.view.shape[3]
        t0 = time.perf_counter()
        if tag is not None and dest is None and self.writer.layouts.of(tag, p.file).gather(self, p, tag, t0):
            return  # its layout gathers it into its placement (the arena: straight into the slot)
        event = None
        if self.cuda:
            host, event = self.copy_async(p.block_ids, n)
        elif self.encode_at_gather:
            host = self.empty_host(n, pin_memory=False)
            self.gather_into(p.block_ids, n, host)
        else:
            host = {HIDDEN_STATES_KEY: self._gather_cpu(p.block_ids, n)}
        self._inflight[p.request_id] = InFlight(event)
        hs, encoded = (None, host) if self.encode_at_gather else (host[HIDDEN_STATES_KEY], None)
        job = WriteJob(p.request_id, p.file, tag, p.token_ids, hs, ready=event.synchronize if event else None,
                       path=dest, lock=lock, encoded=encoded)  # fmt: skip
        job.gather_s = time.perf_counter() - t0
        self.writer.submit(job)

    def _gather_cpu(self, block_ids: list[int], n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows into ``out`` (a slot's span) or a new host tensor, with one copy (counted)."""
        k, h = self.view.shape[2], self.view.shape[3]
        if out is None:
            out = torch.empty((n, k, h), dtype=self.view.dtype)
        if n:
            blocks = torch.tensor(block_ids, dtype=torch.long)
            self.writer.count_copied(gather_rows_into(self.view, blocks, n, out, self.perm))
        return out

    def empty_host(self, n: int, pin_memory: bool) -> dict[str, torch.Tensor]:
        """The host tensors a request's copy fills: the codec's when encoding here, else the rows."""
        k, h = self.view.shape[2], self.view.shape[3]
        if self.encode_at_gather:
            return self.codec.empty_encoded(n, k, h, pin_memory=pin_memory)
        return {HIDDEN_STATES_KEY: torch.empty((n, k, h), dtype=self.view.dtype, pin_memory=pin_memory)}

    def gather_into(self, block_ids: list[int], n: int, out: dict[str, torch.Tensor]) -> None:
        """Copy a request's rows, chunk by chunk, into ``out`` (:meth:`empty_host`), encoding
        each chunk first when encoding here. On CUDA it runs on the side stream (the caller's
        context) and only queues work; on CPU tensors the same code runs synchronously."""
        for first, chunk, ntok in block_chunks(block_ids, n, self.block_size, self.chunk_tokens):
            ids = torch.tensor(chunk, dtype=torch.long)
            if self.cuda:
                # Pinned source + non_blocking: a pageable H2D copy would make the host wait
                # for the side stream, i.e. for the forward.
                ids = ids.pin_memory().to(self.device, non_blocking=True)
            rows = gather_rows(self.view, ids, ntok, self.perm)
            # Chunks hold whole tokens and an on-device encoding is per token: the same bytes
            # as encoding the request's rows at once.
            parts = self.codec.encode(rows) if self.encode_at_gather else {HIDDEN_STATES_KEY: rows}
            for name, t in parts.items():
                out[name][first : first + ntok].copy_(t, non_blocking=True)
                self.writer.count_copied(t.numel() * t.element_size())  # into host memory (on CUDA: the D2H)

    def copy_async(self, block_ids: list[int], n: int,
                    out: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:  # fmt: skip
        """Queue the request's copy on the side stream into ``out`` (a slot's span) or new pinned
        buffers; returns them with the event the writer waits on."""
        host = out if out is not None else self.empty_host(n, pin_memory=True)
        stream = self._stream
        assert stream is not None
        if self._step_start is not None:
            stream.wait_event(self._step_start)
        else:  # no step start seen (a caller outside vLLM's step): everything queued so far
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.gather_into(block_ids, n, host)
            event = torch.cuda.Event()
            event.record(stream)
        return host, event

    def poll(self, candidates: set[str]) -> set[str]:
        """Those of ``candidates`` whose copy has landed (their blocks may now be freed)."""
        done = set()
        for rid in candidates:
            f = self._inflight.get(rid)
            if f is None:
                continue
            if f.event is not None and not f.event.query():
                continue
            del self._inflight[rid]
            done.add(rid)
        return done

    def mark_done(self, request_id: str) -> None:
        self._inflight[request_id] = InFlight(None)

    def drain(self) -> None:
        """Wait until every copy queued so far has landed: vLLM is about to release the cache's
        memory (sleep mode). The copies stay in flight for :meth:`poll` to report as before."""
        for f in self._inflight.values():
            if f.event is not None:
                f.event.synchronize()
        if self._stream is not None:
            self._stream.synchronize()

    def rebind(self, kv_cache: torch.Tensor) -> None:
        """Take the cache tensor again after vLLM gave its memory back (sleep mode's wake-up): a
        view taken before may still point at the released memory, whatever the tensor now holds."""
        self.view = token_major_view(kv_cache, self.block_size, self.view.shape[2])

    def known(self, request_id: str) -> bool:
        return request_id in self._inflight


class WorkerSide:
    """The connector's per-step work on a worker; vLLM-free so every path is unit-testable.

    Only TP rank 0 gathers and writes (every rank holds the same hidden states); the others
    do nothing and report nothing, which is why the plug-in's ``get_finished_count`` is 1.
    """

    def __init__(self, gatherer: HiddenStateGatherer | None, writer: SpoolWriter | None) -> None:
        self.gatherer = gatherer if writer is not None else None
        self.writer = writer
        self._finished: set[str] = set()
        self._locks: dict[str, WriteLock] = {}
        self._lock_errors: dict[str, str] = {}
        self._cache_released = False  # sleep mode: between unregister_kv_caches and restore_kv_caches

    def release_cache(self) -> None:
        """vLLM is releasing the KV cache's memory (sleep mode): finish every copy from it now;
        until :meth:`retake_cache`, a save gets an error notice instead of a read."""
        if self.gatherer is not None:
            self.gatherer.drain()
        self._cache_released = True

    def retake_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM gave the cache's memory back: read it through ``kv_cache`` from now on."""
        if self.gatherer is not None:
            self.gatherer.rebind(kv_cache)
        self._cache_released = False

    def step_starts(self) -> None:
        if self.gatherer is not None:
            self.gatherer.step_starts()

    def step(
        self,
        pending: list[PendingSave],
        finished_req_ids: set[str],
        new_locks: dict[str, LockRequest] | None = None,
    ) -> set[str] | None:
        if self.gatherer is None or self.writer is None:
            return None
        # Locks first: a request scheduled in this step may finish in this step's output, and
        # its client may read the path as soon as the scheduler has seen that output.
        for rid, lr in (new_locks or {}).items():
            if rid in self._locks or rid in self._lock_errors:
                continue  # re-scheduled after a preemption: still held
            try:
                self._locks[rid] = WriteLock(lr.data_path, make_dirs=lr.make_dirs)
            except LockError as e:
                log.error("request %s: %s", rid, e)
                self._lock_errors[rid] = str(e)
        for p in pending:
            lock = self._locks.pop(p.request_id, None)
            lock_error = self._lock_errors.pop(p.request_id, None)
            if p.error is None and (lock_error is not None or self._cache_released):
                # A file its client cannot wait for safely is not written; nor one from a released
                # cache. The scheduler kept the blocks for us (it saw no error): report them.
                p.error = lock_error or "vLLM released its KV cache (sleep mode) before the states were copied"
                self.gatherer.mark_done(p.request_id)
            if p.error is not None:
                if lock is not None:
                    lock.abandon()
                self.writer.submit_error(p.request_id, p.request_tag(), p.error)
                continue
            host_bytes = 0 if self.gatherer.in_place(p) else self.gatherer.nbytes_for(len(p.token_ids))
            if not self.writer.has_room(host_bytes):
                # Writers are behind: refuse before copying anything (nothing to free later).
                if lock is not None:
                    lock.abandon()
                self.gatherer.mark_done(p.request_id)
                self.writer.refuse_busy(p.request_id, p.request_tag())
                continue
            try:
                self.gatherer.submit(p, lock)
            except Exception as e:  # noqa: BLE001 - never take the engine down for one request
                log.exception("gather failed for %s", p.request_id)
                if lock is not None:
                    lock.abandon()
                self.gatherer.mark_done(p.request_id)
                self.writer.submit_error(p.request_id, p.request_tag(), f"gather failed: {e!r}")
        self._finished.update(finished_req_ids)
        done = self.gatherer.poll(self._finished)
        # ids we never copied (error notices, requests freed at once) are not ours to report
        self._finished = {r for r in self._finished if self.gatherer.known(r)}
        return done or None

    def close(self) -> None:
        """Engine shutdown: requests still scheduled will get no file; leave no lock behind."""
        locks, self._locks = self._locks, {}
        for lock in locks.values():
            lock.abandon()
        self._lock_errors.clear()
