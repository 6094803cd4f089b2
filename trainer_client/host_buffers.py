"""Host memory a sample's file is read into before it goes to a GPU (the hook for buffer reuse).

A pinned (page-locked) buffer lets the copy to the GPU run as one non-blocking DMA. What a
*fresh* buffer costs is the trap: on this project's 2-core CPU host, reading a 33.5 MB sample
into a freshly allocated buffer takes ~21 ms against ~9.6 ms into a reused one (the page
faults of new memory; ``bench/costs/validate_throughput.py`` measures both), and a fresh pinned
buffer adds ``cudaHostAlloc``'s page locking on top.

Reuse is torch's own CachingHostAllocator's job, deliberately: it hands a freed pinned block
back only once the non-blocking copies that read it have finished (it records CUDA events), which
a hand-written pool would have to re-implement to avoid overwriting a buffer still being
copied. Its cache grows to the peak number of samples alive at once, which the stream bounds
(its credit, plus what the loop holds). What it does not do is start warm: the first burst
would page-lock one block per sample while the samples wait. :meth:`HostBuffers.warm` takes
that cost once, before the first sample is read.

Every allocation is timed (``stats``, and per sample as ``alloc_s`` in ``Sample.timings``) so
a GPU run shows whether allocation is where the time goes; a different pool plugs in here
(``HiddenStateStream(host_buffers=...)``).
"""

from __future__ import annotations

import threading
import time

import torch


class HostBuffers:
    """Byte buffers for samples' files: ``alloc(n)`` -> uint8 tensor of ``n`` bytes."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._lock = threading.Lock()
        self._warmed: tuple[int, int] = (0, 0)  # (bytes each, count)
        self.stats = {"allocs": 0, "alloc_s": 0.0, "warm_s": 0.0, "warmed": 0}

    def alloc(self, n: int) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats["allocs"] += 1
            self.stats["alloc_s"] += dt
        return buf

    def warm(self, nbytes: int, count: int) -> None:
        """Have ``count`` pinned blocks of ``nbytes`` cached before they are needed: allocate them
        all at once and free them (torch's host allocator keeps freed blocks for reuse). A no-op
        for unpinned buffers and when already warm for this size."""
        if not self.pinned or count <= 0 or (nbytes <= self._warmed[0] and count <= self._warmed[1]):
            return
        t0 = time.perf_counter()
        bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        del bufs
        self._warmed = (max(nbytes, self._warmed[0]), max(count, self._warmed[1]))
        self.stats["warm_s"] += time.perf_counter() - t0
        self.stats["warmed"] = self._warmed[1]
