"""Whether a tensor holds a NaN or an infinity, exactly and fast: on the host, its raw words
(``connector.contract.finite_scan``: the writer's and every reader's one definition), instead
of ``torch.isfinite``, which converts every value to float and writes a bool per value; on a
device, :func:`finite_flag`. Several threads share a host scan by its chunks (:func:`beside`,
:func:`settle`): a thread that starts late or is preempted leaves its chunks to the others.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, wait

import torch

from connector.contract import payload as PL
from connector.contract.finite_scan import CHUNK, ChunkedScan, scan_of_bytes
from trainer_client.sample_reader import shared_pool

_MAX_HELPERS = 7  # threads of a shared scan pool (a caller and 7 helpers: 8 cores' worth)


def _codec(t: torch.Tensor) -> PL.PayloadCodec | None:
    """The payload codec of ``t``'s dtype (None: not a payload dtype)."""
    return PL.CODECS.get(str(t.dtype).removeprefix("torch."))


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device, True unless ``t`` holds a NaN or an infinity, queued
    on the current stream (no host sync): what a device checks. ``torch.isfinite`` where the
    dtype has a kernel; FP8 has none on CUDA (``NotImplementedError``), so an encoded payload is
    tested on its exponent bits, as the host's scan does."""
    codec = _codec(t)
    spec = codec.finite_bits if codec is not None and codec.encoded else None
    if spec is None:
        return torch.isfinite(t).all()
    itype, mask = spec
    return (t.reshape(-1).view(getattr(torch, itype)) & mask).ne(mask).all()


def scannable(t: torch.Tensor) -> bool:
    """Whether ``t`` can have a :class:`ChunkedScan`: contiguous, on the CPU, of a payload dtype."""
    codec = _codec(t)
    return codec is not None and codec.finite_bits is not None and t.device.type == "cpu" and t.is_contiguous()


def scan_of(t: torch.Tensor) -> ChunkedScan:
    """The :class:`ChunkedScan` of a contiguous CPU tensor of a payload dtype (:func:`scannable`)."""
    scan = None
    if scannable(t):
        scan = scan_of_bytes(t.view(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."))
    if scan is None:
        raise TypeError("a chunked scan needs a contiguous CPU tensor of a payload dtype")
    return scan


def beside(scan: ChunkedScan, pool: str, helpers: int) -> list[Future]:
    """Start ``helpers`` threads of the shared pool ``pool`` on ``scan`` from its front; the
    caller joins from the back when it can, then calls :func:`settle`."""
    p = shared_pool(pool, _MAX_HELPERS)
    futures: list[Future] = []
    try:
        for _ in range(helpers):
            futures.append(p.submit(scan.run, True))
    except BaseException:  # e.g. the pool shut down at exit: none of those started is left reading
        scan.stop()
        settle(futures)
        raise
    return futures


def settle(futures: list[Future]) -> None:
    """Once the caller's own share is done: helpers that never started are cancelled, the rest
    waited for, so nothing reads the tensor's bytes after this returns."""
    running = [f for f in futures if not f.cancel()]
    wait(running)
    for f in running:
        f.result()  # a helper's own failure (not a verdict) is raised here, not lost


def all_finite(t: torch.Tensor, threads: int | None = None) -> bool:
    """True unless ``t`` holds a NaN or an infinity; exact, for any float dtype.

    CPU tensors of a payload dtype are checked on their bits (the codec's ``finite_bits``),
    on ``threads`` threads (default: up to 8, numpy releases the GIL), the caller one of them;
    others on their device (:func:`finite_flag`).
    """
    codec = _codec(t)
    spec = codec.finite_bits if codec is not None else None
    if spec is None or t.device.type != "cpu" or t.numel() == 0:
        return bool(finite_flag(t)) if t.is_floating_point() and t.numel() else True
    scan = scan_of(t.contiguous())
    n = min(threads if threads is not None else os.cpu_count() or 1, _MAX_HELPERS + 1)
    if n <= 1 or scan.words.size < 4 * CHUNK:
        return scan.run()
    futures = beside(scan, "finite", n - 1)
    try:
        scan.run(front=False)
    finally:
        settle(futures)
    return scan.ok
