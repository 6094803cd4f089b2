"""The ``arena`` spool layout: every sample in a slot of one shared-memory file the size of the
spool's budget (``connector/contract/arena.py`` has its format, its claims and its locks).

* The sidecar (:class:`ArenaSidecar`) makes or adopts the arena at start-up and gives the ledger
  its allocator of slots (``server/arena.py``); a sample's bytes are its slot's length; a
  remote (zmq) trainer gets the slot's bytes in its DELIVER; Mooncake registers files, so an
  arena sidecar serves only the spool and zmq transports.
* The writer (:class:`ArenaWriter`) maps the arena once per process (again when the sidecar
  made a new one), leases the slot before its first byte, gathers the rows straight into it
  where it can (:meth:`ArenaWriter.gather`), copies the rest in, takes the checksum over the
  slot's own bytes and writes the header last (:meth:`ArenaWriter.write`). Nothing is ever
  written outside the slot.
* The trainer (:class:`ArenaReader`) reads the slot in place under a read hold, copy-on-write
  (``trainer_client.sample_reader.read_slot``); the sample's RECEIVED waits for its views to die
  (``holds_views``), and the trainer never deletes anything.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connector.contract import arena as A
from connector.contract import messages as M
from connector.contract import payload as PL
from connector.contract import sample_file as SF
from connector.layouts import ReaderHalf, SidecarHalf, WriterHalf

if TYPE_CHECKING:
    import torch

    from connector.contract.settings import Settings

log = logging.getLogger("hsstream.connector")


# -- the sidecar's half ---------------------------------------------------------------------------
class ArenaSidecar(SidecarHalf):
    name = "arena"
    #: The same host's trainers read the slot in place; a remote trainer gets the slot's bytes
    #: in its DELIVER. (Mooncake reads files.)
    served_transports = ("spool", "zmq")
    placement_type = A.Slot  # a slot, reserved at submission by the ledger's allocator

    def __init__(self, arena: A.Arena | None = None, quarantine_s: float = 60.0) -> None:
        self.arena = arena
        self.quarantine_s = quarantine_s

    @classmethod
    def from_settings(cls, s: Settings) -> ArenaSidecar:
        return cls(quarantine_s=s.arena_quarantine_s)

    def open(self, spool: Path, settings: Settings, ledger: Any) -> None:
        """One shared-memory file of the budget's size (plus its header page), kept across
        restarts when the size is unchanged; the ledger's rows hold the slots (recover rebuilds)."""
        from server.arena import SlotAllocator, open_arena

        arena, reused = open_arena(spool, settings.spool_budget_bytes + A.PAGE)
        self.arena = arena
        ledger.attach_slots(SlotAllocator(arena.id, arena.size, quarantine_s=self.quarantine_s, arena=arena))
        log.info("spool layout: arena %s, %d MiB (%s)", arena.path, arena.size >> 20, "kept" if reused else "new")

    @staticmethod
    def encode_placement(placement: A.Slot) -> str:
        return placement.model_dump_json()

    @staticmethod
    def decode_placement(text: str) -> A.Slot:
        return A.Slot.model_validate_json(text)

    @staticmethod
    def held_bytes(n: M.Notice, path: Path | None) -> int:
        assert n.slot is not None
        return n.slot.length  # what the slot holds of the arena (the ledger checks it is this attempt's)

    def payload_of(self, n: M.Notice) -> bytes | None:
        """A slot's sample as the bytes a remote trainer gets (what a file would hold)."""
        if n.slot is None:
            return super().payload_of(n)  # a sample too large for the arena: a file
        from connector.contract.sample_file import InvalidSample

        if self.arena is None:
            raise OSError("a slot's sample, and no arena here")
        try:
            view = self.arena.view(n.slot)
            return bytes(view[: A.written_size(view[: A.SLOT_HEADER], n.slot.length)])
        except (A.ArenaError, InvalidSample) as e:
            raise OSError(str(e)) from e


# -- the writer's half ----------------------------------------------------------------------------
class MappedArena:
    """This process's mapping of one arena (one per arena id), as a uint8 tensor the slots'
    tensors are views of. Kept alive by the writes still using it: an arena replaced by the
    sidecar stays mapped (and, on CUDA, registered) until its last write is done."""

    def __init__(self, arena: A.Arena) -> None:
        import torch

        self.arena = arena
        self.id = arena.id
        self.bytes = torch.frombuffer(arena.map, dtype=torch.uint8)
        self.cuda_registered = False
        self._reg_lock = threading.Lock()

    def register_cuda(self) -> bool:
        """Page-lock the whole mapping for the device once (``cudaHostRegister``), so a gather's
        device-to-host copy lands in the slot as one non-blocking DMA. False if the driver
        refuses (the caller copies through a pinned buffer instead)."""
        import torch

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


def _st_name(dtype: torch.dtype) -> str:
    """safetensors' dtype name of a torch dtype a sample's tensors have."""
    for name in PL.safetensors_itemsizes():
        if PL.safetensors_torch_dtype(name) == dtype:
            return name
    raise A.ArenaError(f"{dtype} cannot be laid out in a slot")


class ArenaWriter(WriterHalf):
    name = "arena"

    def __init__(self, spool: Path) -> None:
        super().__init__(spool)
        self._arena: MappedArena | None = None  # the mapping, opened at the first slot
        self._arena_lock = threading.Lock()

    @staticmethod
    def claims(tag: M.RequestTag | None, file: str | None) -> bool:
        return tag is not None and tag.slot is not None

    def notice_fields(self, tag: M.RequestTag | None) -> dict[str, Any]:
        # every notice of a slot sample names it (ok, error, busy)
        return {"slot": tag.slot} if tag is not None and tag.slot is not None else {}

    @staticmethod
    def kv_params(tag: M.RequestTag | None, spool_dir: str | Path, file: str) -> dict[str, Any]:
        """No file will exist, so no path to one: the slot instead."""
        assert tag is not None and tag.slot is not None
        return {M.KV_PARAMS_SLOT_KEY: tag.slot.model_dump(mode="json")}

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

    @staticmethod
    def slot_bytes_for(shape: Any, num_tokens: int) -> int:
        """Bytes a sample of ``num_tokens`` takes in a slot (header room, payload, token ids)."""
        c = PL.codec(shape.dtype)
        per_token = c.bytes_per_position(len(shape.layer_ids), shape.hidden_size) + 8
        return A.SLOT_HEADER + num_tokens * per_token

    # -- on the engine's step (connector/worker_side.py's gatherer) ---------------------------
    def copies_in_place(self, worker: Any, p: Any) -> bool:
        """Whether ``p``'s rows go straight into its slot: when its payload is the cache's own dtype."""
        tag = p.request_tag() if p.tag and p.path is None else None
        if tag is None or tag.slot is None:
            return False
        return PL.codec(worker.writer.shape.dtype).torch_dtype() == worker.view.dtype

    def gather(self, worker: Any, p: Any, tag: M.RequestTag, t0: float) -> bool:
        """A sample of the arena layout: every refusal is an error notice sent before anything
        is copied (the slot's bytes stay as they were); else the gather under the slot's lease."""
        import time as _t

        slot = tag.slot
        assert slot is not None
        n = len(p.token_ids)
        k, h = worker.view.shape[2], worker.view.shape[3]
        try:
            mapped = self.arena_for(slot)
        except A.ArenaError as e:
            worker.mark_done(p.request_id)
            worker.writer.submit_error(p.request_id, tag, f"arena: {e}")
            return True
        need = self.slot_bytes_for(worker.writer.shape, n)
        if need > slot.length:
            worker.mark_done(p.request_id)
            worker.writer.submit_error(p.request_id, tag,
                                       f"slot of {slot.length} bytes too small for the sample's {need}")  # fmt: skip
            return True
        try:
            lease = mapped.lease(slot)  # before a byte is copied into it: refused if given up since
        except A.ArenaError as e:
            worker.mark_done(p.request_id)
            worker.writer.submit_error(p.request_id, tag, f"arena: {e}")
            return True
        try:
            job = self._slot_job(worker, p, tag, slot, mapped, n, k, h)
        except BaseException:
            try:
                if worker._stream is not None:
                    worker._stream.synchronize()  # copies queued into the slot land before it is let go
            finally:
                lease.release()
            raise
        job.lease = lease
        job.gather_s = _t.perf_counter() - t0
        worker.writer.submit(job)
        return True

    def _slot_job(self, worker: Any, p: Any, tag: M.RequestTag, slot: A.Slot, mapped: MappedArena,
                  n: int, k: int, h: int) -> Any:  # fmt: skip
        """The gather of a slot's sample, started (under its lease): into the slot itself, or
        via host memory where the payload is encoded or the mapping is not page-locked."""
        from connector.contract.sample_file import HIDDEN_STATES_KEY
        from connector.spool_writer import WriteJob
        from connector.worker_side import InFlight

        direct = self.copies_in_place(worker, p) and (not worker.cuda or mapped.register_cuda())
        if not direct:  # an encoded payload (FP8), or no page-locked mapping: via host memory
            if worker.cuda:
                host, event = worker.copy_async(p.block_ids, n)
                worker._inflight[p.request_id] = InFlight(event)
                hs, encoded = (None, host) if worker.encode_at_gather else (host[HIDDEN_STATES_KEY], None)
                job = WriteJob(p.request_id, p.file, tag, p.token_ids, hs, ready=event.synchronize, arena=mapped,
                               encoded=encoded)  # fmt: skip
            else:
                host = worker._gather_cpu(p.block_ids, n)
                worker._inflight[p.request_id] = InFlight(None)
                job = WriteJob(p.request_id, p.file, tag, p.token_ids, host, arena=mapped)
        else:
            out = self._slot_hidden_states(worker, mapped, slot, n, k, h)
            if worker.cuda:
                _, event = worker.copy_async(p.block_ids, n, out={HIDDEN_STATES_KEY: out})
                worker._inflight[p.request_id] = InFlight(event)
                ready = event.synchronize
            else:
                worker._gather_cpu(p.block_ids, n, out=out)
                worker._inflight[p.request_id] = InFlight(None)
                ready = None
            job = WriteJob(p.request_id, p.file, tag, p.token_ids, out, ready=ready, in_slot=True, arena=mapped)
        return job

    @staticmethod
    def _slot_hidden_states(worker: Any, mapped: MappedArena, slot: A.Slot, n: int, k: int, h: int) -> torch.Tensor:
        """The hidden states' span of the slot, as the header will lay it out (safetensors' order)."""
        st = PL.codec(worker.writer.shape.dtype).safetensors_dtype
        es = worker.view.element_size()
        specs = [(SF.HIDDEN_STATES_KEY, st, [n, k, h], n * k * h * es), (SF.TOKEN_IDS_KEY, "I64", [n], 8 * n)]
        return mapped.tensor(slot, A.data_spans(specs)[SF.HIDDEN_STATES_KEY], worker.view.dtype, (n, k, h))

    # -- on a writer thread -------------------------------------------------------------------
    def write(self, writer: Any, job: Any) -> M.Notice:
        """Into the tag's slot, never past its end: its tensors copied into their spans (the
        hidden states usually gathered there already), the checksum over the slot's own bytes,
        the header written last, then the notice (``file`` None, ``slot`` set)."""
        import torch

        w = writer
        slot = job.tag.slot
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
                payload = {SF.HIDDEN_STATES_KEY: hs} if job.in_slot else w.encode(hs)
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
                w.count_copied(v.numel() * v.element_size())
            # Over the slot's own bytes, the finiteness scan in the same pass.
            digest, finite = SF.checksum_and_finite(views, algo=w.checksum_algo, threads=w.checksum_threads)
            t2 = time.perf_counter()
            notice = w.notice(
                job.request_id,
                job.tag,
                status=M.NoticeStatus.ok,
                file=None,
                slot=slot,
                num_tokens=int(ids.shape[0]),
                nbytes=sum(sp[3] for sp in specs if sp[0] != SF.TOKEN_IDS_KEY),
                checksum=digest,
                checksum_algo=w.checksum_algo,
                finite=finite,
            )
            header, _ = A.header_for(specs, SF.header_metadata(notice))
            mapped.write_header(slot, header)
            w.count_copied(len(header))
            t3 = time.perf_counter()
            timings = {"gather": job.gather_s, "queue": t0 - job.created, "copy_wait": t1 - t0, "checksum": t2 - t1,
                       "write": t3 - t2}
            notice = notice.model_copy(update={"timings": {k: round(v, 6) for k, v in timings.items()}})
        except BaseException as e:  # noqa: BLE001 - every failure must become a notice
            log.exception("hidden-state write into slot %s+%s failed for %s", slot.offset, slot.length, job.request_id)
            notice = w.notice(job.request_id, job.tag, status=M.NoticeStatus.error, reason=f"write failed: {e!r}")
        finally:
            job.hidden_states = None
            job.arena = None
            if job.lease is not None:
                job.lease.release()  # after the header: the sidecar may void the slot from here
                job.lease = None
            if job.lock is not None:
                job.lock.abandon()
        return notice


# -- the trainer's half ---------------------------------------------------------------------------
class ArenaReader(ReaderHalf):
    name = "arena"
    holds_views = True
    trusted_in_place = True

    def __init__(self, spool: Path | None, prefault: bool = True) -> None:
        super().__init__(spool)
        self.prefault = prefault  # off only for bench/arena/arena_pages.py's control arm
        self._maps: Any = None  # the stream's copy-on-write mapping (ArenaMaps), at the first slot
        self._lock = threading.Lock()

    @staticmethod
    def claims(n: M.Notice) -> bool:
        return n.slot is not None and n.file is None

    def maps(self) -> Any:
        from trainer_client.sample_reader import ArenaMaps

        with self._lock:
            if self._maps is None:
                if self.spool is None:
                    from connector.contract.sample_file import InvalidSample

                    raise InvalidSample("delivery of an arena slot, and no arena to read it from")
                self._maps = ArenaMaps(self.spool, prefault=self.prefault)
            return self._maps

    def open(self, n: M.Notice, *, pin_memory: bool, alloc: Callable[[int], torch.Tensor] | None,
             device: Any, timings: dict[str, float], on_header: Callable | None,
             on_release: Callable[[], None] | None) -> dict[str, torch.Tensor]:  # fmt: skip
        """The slot's tensors, views of the stream's private mapping, or copied out at once into
        pinned memory or for a CUDA device (``sample_reader.slot_is_copied``), under its read hold;
        its header must hold this delivery's notice (:func:`check_slot_notice`)."""
        import torch

        from trainer_client.sample_reader import read_slot, slot_is_copied

        arena = self.maps().get(n.slot)
        # Into pinned memory, or to a CUDA device (from there, one DMA): one copy out, at once.
        copy = slot_is_copied(device, pin_memory)
        pinned = alloc or (lambda k: torch.empty(k, dtype=torch.uint8, pin_memory=True))
        tensors = read_slot(arena, n.slot, copy_into=pinned if copy else None, on_release=on_release,  # type: ignore[arg-type]
                            on_meta=lambda meta: check_slot_notice(meta, n), timings=timings, on_header=on_header)
        if not copy:
            timings["in_slot"] = 1  # the tensors are views of the slot (the stream clones the ids if it decodes)
        return tensors

    def where(self, n: M.Notice) -> str:
        return f"its arena slot {n.slot}"

    def close(self) -> None:
        with self._lock:
            if self._maps is not None:
                self._maps.close()  # the mapping itself stays while views of it live


def check_slot_notice(meta: dict[str, str], n: M.Notice) -> None:
    """The slot's header must hold the delivered sample's notice: same key, attempt and slot
    generation. Another is a write of another attempt (late, or into a slot since reassigned)."""
    from connector.contract.sample_file import InvalidSample

    raw = meta.get(SF.HEADER_NOTICE_KEY)
    if raw is None:
        raise InvalidSample(f"slot header without {SF.HEADER_NOTICE_KEY}")
    try:
        hn = M.Notice.decode(raw)
    except M.ProtocolError as e:
        raise InvalidSample(f"slot header: bad notice: {e}") from e
    assert n.slot is not None
    if hn.key != n.key or hn.attempt != n.attempt or hn.slot is None or hn.slot.generation != n.slot.generation:
        raise InvalidSample(
            f"slot holds another write (key {hn.key}, attempt {hn.attempt}, generation "
            f"{hn.slot.generation if hn.slot else None}), not the delivered {n.key} attempt {n.attempt} "
            f"generation {n.slot.generation}"
        )
    # A trusted slot takes no checksum: what the delivery says of its bytes (their checksum, the
    # writer's finiteness verdict, the token count) must be what its writer wrote beside them.
    for field in ("checksum", "checksum_algo", "finite", "num_tokens", "dtype", "layer_ids", "hidden_size"):
        if getattr(hn, field) != getattr(n, field):
            raise InvalidSample(f"slot header's {field} {getattr(hn, field)!r} differs from the delivery's "
                                f"{getattr(n, field)!r}")  # fmt: skip
