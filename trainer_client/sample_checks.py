"""One sample's checks against its notice and what the sidecar submitted: its tensors, shapes
and dtype from the header before the data is read, then the checksum, the payload's own
tensors (its codec's ``check``), finite values and the token ids. A sample that fails any is an
:class:`InvalidSample`, reported failed and produced again, never yielded.

Order of the work for one file: ``load_and_check`` builds a :class:`_SampleChecks` and hands its
``start`` to the reader (``sample_reader.read_sample_file``) as the header callback; ``start``
checks the header and, for a CUDA device, returns a feed that sends each part of the hidden
states to ``device_copy.DeviceCopy`` as it arrives; once the file is in, ``host_checks`` runs
the rest and ``load_and_check`` collects the device copy. Without a device, the writer's
finiteness verdict in the notice stands once the checksum matches; where there is none (or
``rescan_finite``), the scan goes with the checksum (:meth:`_SampleChecks.host_checks`).

A delivery read from the spool is opened by its spool layout's reader half
(``connector/layouts/``: ``ReaderHalf.open``). The arena's reads its slot in place, under its
read hold: its tensors are views of the trainer's copy-on-write mapping of the slot, unless the
sample goes into pinned memory or to a CUDA device, where they are copied from the slot at once;
the slot's header must hold this delivery's notice (same key, attempt and slot generation).
Bytes a layout reads in place from a placement only their writer wrote (``trusted_in_place``)
take no checksum (unless ``verify_slots``): only its claim's writer ever writes a slot, under its
lease, no one writes it again while it is held, and the trainer's own in-place ops stay in its
private pages (``connector/contract/arena.py``). Once the hidden states are on the device its
token ids are copied out too (a few bytes), so nothing holds the slot.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from connector.contract import messages as M
from connector.contract import payload as PL
from connector.contract import sample_file as SF
from connector.contract.sample_file import InvalidSample
from connector import layouts as L
from trainer_client.device_copy import DeviceCopy, to_device_checked
from trainer_client.finite import all_finite, beside, scan_of, scannable, settle
from trainer_client.sample import Sample
from trainer_client.sample_reader import read_sample_file

def load_and_check(spool: Path | None, d: M.Deliver, payload: bytes | memoryview | None = None, *, require_key: bool = True,
                   pin_memory: bool = False, checksum_threads: int = 0, device: torch.device | str | None = None,
                   alloc: Callable[[int], torch.Tensor] | None = None,
                   timings: dict[str, float] | None = None, readers: L.Readers | None = None,
                   on_release: Callable[[], None] | None = None, rescan_finite: bool = False,
                   verify_slots: bool = False) -> Sample:  # fmt: skip
    """Read a delivered sample (from the spool, or from the bytes a remote trainer received)
    and check it against its notice and what the sidecar submitted. ``require_key=False``:
    a file from a plain vLLM request (no sample key), see :func:`read_hidden_states`.

    ``pin_memory``: the tensors live in page-locked memory, ready for a non-blocking copy to
    a GPU (``alloc`` gives the buffer). ``checksum_threads`` (0: all useful) does not change
    the digest. Safe to call from several threads at once (the stream's check workers).

    ``device`` (the trainer's): the hidden states (and FP8 scales) are copied there and their
    finiteness is checked there; the sample is returned with them on that device. None or a CPU
    device: checked on the host. On a CUDA device each part of the hidden states is
    copied as soon as it is read (:class:`_SampleChecks`), so the copy overlaps the read, and
    the finiteness check there overlaps the host's checksum; a sample refused later has its
    device copy dropped, never returned. ``timings`` receives each phase's seconds, and
    ``bytes_copied`` the host bytes copied to get the tensors (a file read into a buffer, a
    transport's payload copied or parsed, a slot copied out; not a mapped file's pages, not the
    copy to the device).

    ``readers``: the stream's spool-layout reader halves (``connector.layouts.Readers``: the
    arena's keeps the stream's mapping), for a delivery read from the spool (module docstring);
    ``on_release`` is called (any thread) once no view of a held placement (a slot) is left and
    its hold is let go (``read_slot``). A slot this trainer cannot reach or hold raises
    ``sample_reader.SlotNotReadable``.

    ``rescan_finite``: scan the values on the host even where the writer said they are all
    finite (``Notice.finite``). Without it a matching checksum stands for the scan: the bytes
    are the ones the writer hashed and scanned in the same pass. A writer that said some are
    not finite is refused either way.

    ``verify_slots``: take the checksum of a slot read in place too. Without it a slot's bytes
    are trusted: only the writer holding the slot's claim and lease writes them
    (``connector/contract/arena.py``), so they are the bytes it hashed and scanned; the notice's
    finiteness verdict stands for them as a matching checksum's would.
    """
    tm = timings if timings is not None else {}
    n = d.notice
    if (n.file is None and n.slot is None) or (require_key and n.key is None):
        raise InvalidSample("delivery without a file or key")
    if n.checksum_algo not in SF.CHECKSUM_ALGOS:
        raise InvalidSample(f"unknown checksum algorithm {n.checksum_algo!r}")
    if n.dtype not in PL.CODECS:
        raise InvalidSample(f"unknown payload dtype {n.dtype!r} in the notice")
    dev = torch.device(device) if device is not None else None
    half = None
    if payload is None:  # read from the spool, by the sample's layout
        if readers is None:
            if L.holds_views(n):  # its reads need the stream's state (the arena's mapping)
                raise InvalidSample("delivery of an arena slot, and no arena to read it from")
            readers = L.Readers(spool)
        half = readers.of(n)
    trusted = half is not None and half.trusted_in_place and not verify_slots
    checks = _SampleChecks(n, dev, checksum_threads, tm, rescan_finite, trusted=trusted)
    copied = 0
    if half is not None:
        tensors = half.open(n, pin_memory=pin_memory, alloc=alloc, device=dev, timings=tm, on_header=checks.start,
                            on_release=on_release)  # fmt: skip
    else:
        tensors = read_sample_file(payload=payload, pin_memory=pin_memory, alloc=alloc, timings=tm, on_header=checks.start)
    tm["bytes_copied"] = tm.get("bytes_copied", 0) + copied
    hs, ids, scales = checks.host_checks(tensors)
    if d.expected_token_ids is not None and ids.tolist() != d.expected_token_ids:
        raise InvalidSample("token ids differ from the ones submitted")
    mask = torch.tensor(d.loss_mask, dtype=torch.bool) if d.loss_mask is not None else None
    if mask is not None and mask.shape[0] != n.num_tokens:
        raise InvalidSample(f"loss mask has {mask.shape[0]} entries for {n.num_tokens} tokens")
    if checks.copy is not None:
        hs, scales = checks.copy.finish()
    elif dev is not None and dev.type != "cpu":
        hs, scales = to_device_checked(hs, scales, dev, tm)
    if dev is not None and dev.type != "cpu" and tm.pop("in_slot", 0):
        ids = ids.clone()  # the hidden states are on the device: nothing else holds the slot
        tm["bytes_copied"] += ids.numel() * ids.element_size()
    return Sample(n.key, ids, hs, list(n.layer_ids), n.num_hidden_layers, mask, d.label, n, scales)


class _SampleChecks:
    """One sample's checks against its notice, run as its file arrives: the header's tensors,
    shapes and dtype before any data is read (:meth:`start`), then on a CUDA device each part of
    the hidden states copied there as it arrives (:meth:`_feed`); the rest once the file is in
    (:meth:`host_checks`)."""

    def __init__(self, n: M.Notice, dev: torch.device | None, threads: int, tm: dict[str, float],
                 rescan_finite: bool = False, trusted: bool = False) -> None:  # fmt: skip
        self.n, self.dev, self.tm, self.threads = n, dev, tm, threads
        self.trusted = trusted  # a slot read in place: no checksum (load_and_check's verify_slots)
        self.rescan_finite = rescan_finite
        self.copy: DeviceCopy | None = None
        self.span = (0, 0)
        self.hs_bytes: torch.Tensor | None = None
        self.pinned = False

    def start(self, tensors: dict, spans: dict[str, tuple[int, int]] | None) -> Callable[[int, int], None] | None:
        n = self.n
        if set(tensors) != PL.tensor_names(n.dtype):
            raise InvalidSample(f"unexpected tensors {sorted(tensors)} for a {n.dtype} payload "
                                f"(expected {sorted(PL.tensor_names(n.dtype))})")  # fmt: skip
        hs, ids = tensors[SF.HIDDEN_STATES_KEY], tensors[SF.TOKEN_IDS_KEY]
        T = n.num_tokens
        if ids.dim() != 1 or ids.shape[0] != T:
            raise InvalidSample(f"token_ids shape {tuple(ids.shape)}, notice says {T} tokens")
        if tuple(hs.shape) != (T, len(n.layer_ids), n.hidden_size):
            raise InvalidSample(f"hidden_states shape {tuple(hs.shape)} != {(T, len(n.layer_ids), n.hidden_size)}")
        if str(hs.dtype).removeprefix("torch.") != n.dtype:
            raise InvalidSample(f"dtype {hs.dtype} != notice {n.dtype}")
        if self.dev is None or self.dev.type != "cuda":
            return None
        self.hs_bytes = hs.contiguous().view(-1).view(torch.uint8)
        nbytes = self.hs_bytes.numel()
        self.span = spans[SF.HIDDEN_STATES_KEY] if spans is not None else (0, nbytes)
        self.pinned = hs.is_pinned()
        self.copy = DeviceCopy(hs.shape, hs.dtype, self.dev, self.tm, scales_like=tensors.get(PL.SCALES_KEY))
        return self._feed if spans is not None else (lambda a, b: self._feed(0, nbytes))

    def _feed(self, a: int, b: int) -> None:
        """Bytes [a, b) of the file are in: the hidden states' share of them goes to the device."""
        h0, h1 = self.span
        lo, hi = max(a, h0), min(b, h1)
        if lo < hi and self.copy is not None and self.hs_bytes is not None:
            self.copy.part(self.hs_bytes[lo - h0 : hi - h0], lo - h0, non_blocking=self.pinned)

    def host_checks(self, tensors: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The file is in: the checksum, the scales, finiteness on the host (without a device)
        and the scales' copy to the device; returns (hidden states, ids, scales), on the host.

        Finiteness on the host: the writer's verdict (``Notice.finite``), which a matching
        checksum (or, for a trusted slot, its lease) makes this sample's, unless ``rescan_finite``; else a scan that goes with the
        checksum: beside it on the ``scan`` pool, the hashing thread taking the chunks left once
        its checksum is done (several cores), or chunk by chunk in the checksum's own pass (one
        core, xxh3-128); ``bench/costs/host_checks.py`` measures them."""
        hs, ids = tensors[SF.HIDDEN_STATES_KEY], tensors[SF.TOKEN_IDS_KEY]
        on_host = self.dev is None or self.dev.type == "cpu"
        algo = self.n.checksum_algo
        taken = on_host and self.n.finite is not None and not (self.n.finite and self.rescan_finite)
        scan_here = on_host and not taken
        pooled = scan_here and CPUS > 1 and hs.numel() >= _BESIDE_MIN and scannable(hs)
        scan = scan_of(hs) if pooled else None
        helpers = None
        found: bool | None = None  # the one-pass verdict (None: not taken in the checksum's pass)
        try:
            if pooled:
                helpers = beside(scan, "scan", min(CPUS, 8) - 1)  # type: ignore[arg-type]
            if not self.trusted:  # trusted: its writer's bytes (the slot's lease); a due scan runs below
                t0 = time.perf_counter()
                if scan_here and not pooled:  # one core: the writer's own pass (None where it does not apply)
                    digest, found = SF.checksum_and_finite(tensors, algo=algo, threads=self.threads)
                else:
                    digest = SF.sample_checksum(tensors, algo=algo, threads=self.threads)
                self.tm["checksum_s"] = time.perf_counter() - t0  # fused: the scan's time is in it
                if digest != self.n.checksum:
                    raise InvalidSample("checksum mismatch")
            try:
                PL.codec(self.n.dtype).check(tensors, self.n.num_tokens)  # the payload's own tensors
            except PL.PayloadError as e:
                raise InvalidSample(str(e)) from e
            scales = tensors.get(PL.SCALES_KEY)
            if scales is not None and self.copy is not None:
                self.copy.scales(scales)
            if on_host:
                t0 = time.perf_counter()
                if taken:
                    ok = bool(self.n.finite)  # these are the bytes the writer scanned
                elif found is not None:
                    ok = found  # scanned as it was hashed
                elif scan is None:
                    ok = all_finite(hs)
                else:  # what the helpers have not taken yet, from the back; then theirs
                    scan.run(front=False)
                    pending, helpers = helpers, None
                    settle(pending)  # waits for every helper, then raises a helper's own error, if any
                    ok = scan.ok
                if not ok:
                    raise InvalidSample("non-finite hidden states" + (" (the writer found them)" if taken else ""))
                self.tm["finite_s"] = time.perf_counter() - t0  # beside the checksum: what was left of it
        finally:
            if helpers is not None:
                scan.stop()  # type: ignore[union-attr]  # refused before its scan ended: the helpers stop
                settle(helpers)  # however this ends, nothing reads the sample's bytes after it
        return hs, ids, scales


#: Cores this process may run on: a large sample's finiteness scan is shared among up to 8 of them
#: (1: scanned in the checksum's pass on one core). Module-level so a benchmark can compare the two.
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_BESIDE_MIN = 1 << 20  # values: below, a thread hand-off costs more than the scan


def read_hidden_states(path: str | os.PathLike[str], expected_token_ids: list[int] | None = None, *,
                       dequantize: torch.dtype | None = torch.bfloat16, rescan_finite: bool = False) -> Sample:  # fmt: skip
    """Read and validate one file our connector wrote, without a sidecar: shapes, dtype,
    checksum, finite values and token ids against the notice in its header (and against
    ``expected_token_ids`` if given). Works for plain vLLM requests (no sample key; ``key`` is
    None). Wait for the file first as for vLLM's Example connector (``<path>.lock``).
    ``dequantize``: the dtype an FP8 payload is turned into (None: keep FP8 + ``scales``).
    ``rescan_finite``: scan the values even where the header's notice says the writer found
    them all finite (see :func:`load_and_check`)."""
    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure is an invalid file
        raise InvalidSample(f"{p}: not a readable safetensors file: {e}") from e
    if SF.HEADER_NOTICE_KEY not in meta:
        raise InvalidSample(f"{p}: no {SF.HEADER_NOTICE_KEY} in its header (not written by this connector)")
    try:
        n = M.Notice.decode(meta[SF.HEADER_NOTICE_KEY])
    except M.ProtocolError as e:
        raise InvalidSample(f"{p}: bad header notice: {e}") from e
    if n.status != M.NoticeStatus.ok:
        raise InvalidSample(f"{p}: header notice has status {n.status.value}")
    d = M.Deliver(notice=n.model_copy(update={"file": p.name}), expected_token_ids=expected_token_ids)
    return load_and_check(p.parent, d, require_key=False, rescan_finite=rescan_finite).dequantized(dequantize)
