"""A checked sample's hidden states on their way to the trainer's CUDA device: copied in parts
as the file is read, on each check worker's own side stream, with their finiteness checked
there (``HiddenStateStream(device=…)``); on another device, one plain copy and the host's check.
"""

from __future__ import annotations

import threading
import time

import torch

from connector.contract.sample_file import InvalidSample
from trainer_client.finite import all_finite, finite_flag

_side = threading.local()  # one CUDA stream per check worker, so their copies overlap


class DeviceCopy:
    """Hidden states on their way to a CUDA ``device`` in parts (:meth:`part`: a non-blocking
    copy from pinned memory on this thread's own side stream), with their finiteness checked
    there once the last part is queued (far cheaper on the GPU than the host's exponent-bit
    scan), so the host goes on (reading, hashing)
    meanwhile; :meth:`finish` waits and returns the tensors, complete, or raises
    :class:`InvalidSample`. They are allocated on the device's current stream and marked used by
    the side stream, so the caching allocator never hands them out early (torch's pinned cache
    likewise keeps a source buffer until the copies reading it are done). The FP8 scales' buffer
    (``scales_like``: their shape and dtype, known from the header) is allocated with them,
    before the side stream's one wait: allocated later, it could be a block the trainer's step
    just freed on the current stream, still in use by kernels the side stream never waited for."""

    def __init__(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 timings: dict[str, float] | None = None, scales_like: torch.Tensor | None = None) -> None:  # fmt: skip
        self.t0 = time.perf_counter()
        self.timings = timings
        s = getattr(_side, "stream", None)
        if s is None or s.device != device:
            s = _side.stream = torch.cuda.Stream(device)
        self.stream = s
        self.device = device
        self.out = torch.empty(shape, dtype=dtype, device=device)
        self.bytes = self.out.view(-1).view(torch.uint8)
        self.sc = None if scales_like is None else torch.empty(scales_like.shape, dtype=scales_like.dtype,
                                                               device=device)  # fmt: skip
        self.ok: torch.Tensor | None = None
        s.wait_stream(torch.cuda.current_stream(device))  # the allocations are ordered before the copies
        for t in (self.out, self.sc):
            if t is not None:
                t.record_stream(s)

    def part(self, src: torch.Tensor, offset: int, *, non_blocking: bool = True) -> None:
        """Bytes ``src`` (uint8, on the host) of the hidden states, at byte ``offset``."""
        with torch.cuda.stream(self.stream):
            self.bytes[offset : offset + src.numel()].copy_(src, non_blocking=non_blocking)
            if offset + src.numel() == self.bytes.numel():
                self.ok = finite_flag(self.out)

    def scales(self, scales: torch.Tensor) -> None:
        """The FP8 scales, into the buffer ``scales_like`` announced (allocated before the wait)."""
        if self.sc is None or self.sc.shape != scales.shape or self.sc.dtype != scales.dtype:
            raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype} were not announced (scales_like)")
        with torch.cuda.stream(self.stream):
            self.sc.copy_(scales, non_blocking=scales.is_pinned())

    def finish(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.cuda.stream(self.stream):
            if self.ok is None:  # no bytes (0 tokens)
                self.ok = finite_flag(self.out)
            ok = bool(self.ok)  # waits for the copies and the check on the side stream
        if self.timings is not None:
            self.timings["to_device_s"] = time.perf_counter() - self.t0
        if not ok:
            raise InvalidSample("non-finite hidden states (checked on the device)")
        return self.out, self.sc


def to_device_checked(hs: torch.Tensor, scales: torch.Tensor | None, device: torch.device,
                      timings: dict[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``hs`` (and ``scales``) copied to ``device``, raising :class:`InvalidSample` unless every
    value is finite, checked there (:class:`DeviceCopy` on CUDA)."""
    if device.type == "cuda":
        copy = DeviceCopy(hs.shape, hs.dtype, device, timings, scales_like=scales)
        copy.part(hs.contiguous().view(-1).view(torch.uint8), 0, non_blocking=hs.is_pinned())
        if scales is not None:
            copy.scales(scales)
        return copy.finish()
    t0 = time.perf_counter()
    out = hs.to(device)
    sc = scales.to(device) if scales is not None else None
    ok = all_finite(out)
    if timings is not None:
        timings["to_device_s"] = time.perf_counter() - t0
    if not ok:
        raise InvalidSample("non-finite hidden states (checked on the device)")
    return out, sc
