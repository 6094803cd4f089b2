"""The trainer's data path: samples from the stream → batches → tensors on the training device.

Three pieces, each replaceable on its own:

* :class:`BatchSource` takes samples from the stream on the loop's own thread (the stream's
  rule: one thread owns its socket), checks each against the draft (the plug-in's ``check``), leaves out what the
  weights already hold and applies the negative control. An idle yield of the stream (``None``)
  ends a batch early, so the loop can checkpoint or join the other ranks instead of blocking.
* :class:`DeviceCopier` turns a batch into the step's tensors on the device (the draft plug-in
  selects the layers and packs the row: ``features``, ``pack``). On CUDA the
  sample tensors (pinned by the stream) are copied with ``non_blocking=True`` on a side stream,
  the layer selection and packing run there too, and an event marks the batch ready; the step
  makes the compute stream wait for that event (not the host) and hands the tensors over with
  ``record_stream``. The host tensors are kept until the step that used them has finished.
* :class:`Prefetcher` holds up to ``depth`` batches copied ahead: the loop queues step *k* on
  the GPU, fills the prefetcher (fetch, validate, copy batch *k+1*) while the GPU works, then
  waits for step *k*. Everything happens on one thread; nothing but the loop touches the stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from connector import protocol as P
from trainer_client.drafts.base import Features, features, loss_tokens, pack, pad_to_bucket, swap_aux
from trainer_client.stream import Sample


@dataclass
class HostBatch:
    """What one step trains on, as the stream delivered it (host memory, pinned on CUDA)."""

    samples: list[Sample] = field(default_factory=list)
    donors: list[Sample | None] = field(default_factory=list)  # control: aux states from these
    yielded: list[P.SampleKey] = field(default_factory=list)  # every key the stream gave for it, in order
    settled: list[str] = field(default_factory=list)  # yielded, not trained: in the weights already / first donor
    skipped: int = 0  # of ``settled``: already in the weights
    no_loss: int = 0  # of ``settled``: no position carries loss (nothing to learn, a loss of 0)
    tokens: int = 0
    loss_tokens: int = 0

    @property
    def keys(self) -> list[str]:
        return [str(s.key) for s in self.samples]


class BatchSource:
    """Host batches from a stream of samples (``None`` items are the stream's idle yields)."""

    def __init__(self, stream: Iterable[Sample | None], *, check: Callable[[Sample], None],
                 already_trained: Callable[[str], bool], samples_per_step: int, max_tokens_per_step: int,
                 control: str = "none", hold_out: Callable[[Sample], bool] | None = None,
                 count_loss: Callable[[Sample], int] = loss_tokens) -> None:  # fmt: skip
        self.count_loss = count_loss  # the loss-carrying positions of a sample, as its draft packs it
        self._it: Iterator[Sample | None] = iter(stream)
        self.check = check
        self.already_trained = already_trained
        self.samples_per_step = samples_per_step
        self.max_tokens_per_step = max_tokens_per_step
        self.control = control
        self.hold_out = hold_out  # True: kept for evaluation (settled, never trained)
        self._donor: Sample | None = None
        self.ended = False
        self.seen = 0  # samples yielded by the stream

    def next(self) -> HostBatch | None:
        """The next batch; a partial one when the stream goes idle or ends; None when nothing came."""
        b = HostBatch()
        while len(b.samples) < self.samples_per_step and b.tokens < self.max_tokens_per_step and not self.ended:
            try:
                smp = next(self._it)
            except StopIteration:
                self.ended = True
                break
            if smp is None:  # idle: let the loop do its other work
                break
            self.check(smp)
            self.seen += 1
            b.yielded.append(smp.key)
            key = str(smp.key)
            if self.already_trained(key):  # already in the weights; only its ack may have been lost
                b.settled.append(key)
                b.skipped += 1
                continue
            if self.hold_out is not None and self.hold_out(smp):  # acknowledged with the next checkpoint
                b.settled.append(key)
                continue
            if self.count_loss(smp) == 0:
                # Nothing to learn (the sidecar refuses such samples at admission; a job queued
                # before it did, or a one-token reply, still may bring one): never a step of loss 0.
                b.settled.append(key)
                b.no_loss += 1
                continue
            donor = None
            if self.control == "swap-hidden":
                donor, self._donor = self._donor, smp
                if donor is None:  # the first sample only donates
                    b.settled.append(key)
                    continue
            b.samples.append(smp)
            b.donors.append(donor)
            t = int(smp.token_ids.shape[0])
            if donor is not None:
                t = min(t, int(donor.token_ids.shape[0]))
                smp_cut = Sample(smp.key, smp.token_ids[:t], smp.hidden_states[:t], smp.layer_ids,
                                 smp.num_hidden_layers, smp.loss_mask[:t] if smp.loss_mask is not None else None)  # fmt: skip
                b.loss_tokens += self.count_loss(smp_cut)
            else:
                b.loss_tokens += self.count_loss(smp)
            b.tokens += t
        return b if b.yielded else None


class CudaOps:
    """The CUDA calls of the data path and the step, in one place (a fake stands in for them in
    the CPU unit tests, which check the order: copy on the side stream, event, wait, hand-over)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def side(self) -> AbstractContextManager:
        return torch.cuda.stream(self.copy_stream)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        # From pageable memory a "non-blocking" copy is a synchronous one: pin small tensors
        # (loss masks) first; the stream already pins the hidden states.
        if not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.copy_stream)
        return ev

    def wait(self, ev: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(ev)

    def hand_over(self, t: torch.Tensor) -> None:
        # Allocated on the copy stream, used on the compute stream: the allocator must not
        # reuse its memory before the compute stream is done with it.
        t.record_stream(torch.cuda.current_stream(self.device))

    def timer(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @staticmethod
    def elapsed_s(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def device_ops(device: torch.device) -> CudaOps | None:
    return CudaOps(device) if device.type == "cuda" else None


@dataclass
class Staged:
    """A batch on its way to (or on) the device."""

    host: HostBatch
    tensors: dict[str, torch.Tensor] | None  # pack(): the step's input; None: nothing to train
    tokens: int
    event: object | None = None  # set on CUDA: the copy and packing are done when it fires


class DeviceCopier:
    """Host batches → the step's packed tensors on the device (see the module docstring)."""

    def __init__(self, device: torch.device, aux_layer_ids: list[int], ops: CudaOps | None = None,
                 draft=None) -> None:  # noqa: ANN001  # fmt: skip
        """``draft``: the plug-in whose ``features`` and ``pack`` make the step's tensors (None: the
        shared shifted packing, as Eagle-3 and P-EAGLE take it)."""
        self._feat, self._pack = (features, pack) if draft is None else (draft.features, draft.pack)
        # On CUDA the row is padded to one of a few lengths (Draft.device_row: compiled forwards)
        self._device_row = pad_to_bucket if draft is None else draft.device_row
        self.device = device
        self.aux_layer_ids = aux_layer_ids
        self.ops = ops
        self.staged = 0  # batches copied through the side stream

    def _features(self, b: HostBatch, dtype: torch.dtype | None, to) -> list[Features]:  # noqa: ANN001
        out = []
        for smp, donor in zip(b.samples, b.donors, strict=True):
            f = self._feat(smp, self.aux_layer_ids, dtype=dtype, to=to)
            if donor is not None:
                f = swap_aux(f, self._feat(donor, self.aux_layer_ids, dtype=dtype, to=to))
            out.append(f)
        return out

    def stage(self, b: HostBatch) -> Staged:
        if not b.samples:
            return Staged(b, None, 0)
        if self.ops is None:  # CPU: float32 (no autocast on CPU: see resolve_autocast)
            feats = self._features(b, torch.float32, None)
            return Staged(b, self._pack(feats), sum(f.num_tokens for f in feats))
        with self.ops.side():
            feats = self._features(b, None, self.ops.to_device)
            tensors = self._device_row(self._pack(feats))
            ev = self.ops.record()
        self.staged += 1
        return Staged(b, tensors, sum(f.num_tokens for f in feats), ev)

    def ready(self, st: Staged) -> dict[str, torch.Tensor] | None:
        """The batch's tensors, safe to use from work queued on the current stream from now on."""
        if self.ops is not None and st.event is not None and st.tensors is not None:
            self.ops.wait(st.event)
            for t in st.tensors.values():
                self.ops.hand_over(t)
        return st.tensors


class Prefetcher:
    """Up to ``depth`` batches fetched and copied ahead of the step (0: fetch when asked)."""

    def __init__(self, source: BatchSource, copier: DeviceCopier, depth: int = 0) -> None:
        self.source = source
        self.copier = copier
        self.depth = max(0, depth)
        self._q: deque[Staged] = deque()

    def take(self) -> Staged | None:
        """The next batch: a prefetched one, else fetched now; None when nothing came."""
        if self._q:
            return self._q.popleft()
        b = self.source.next()
        return self.copier.stage(b) if b is not None else None

    def fill(self) -> None:
        """Fetch and copy ahead until ``depth`` batches wait (stops at an idle yield or the end)."""
        while len(self._q) < self.depth and not self.source.ended:
            b = self.source.next()
            if b is None:
                return
            self._q.append(self.copier.stage(b))

    @property
    def queued(self) -> int:
        return len(self._q)

    @property
    def exhausted(self) -> bool:
        """The stream has ended and nothing fetched is left."""
        return self.source.ended and not self._q
