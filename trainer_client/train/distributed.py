"""Several trainer ranks: who we are, and the few collectives the loop needs.

Each rank opens its own ``HiddenStateStream``; the sidecar leases every sample to exactly one
consumer, so ranks get disjoint samples without any sharding here. What ranks must agree on
is *when*: every step (all ranks step together, a rank without a batch contributes a zero
gradient), when to checkpoint, and when to stop (all streams ended). That takes one small
all-reduce of counters per step on the CPU (gloo), the gradient all-reduce on the device's
backend (NCCL on GPUs, gloo on CPU), and at a checkpoint a gather of keys and a broadcast of
"saved" from rank 0.

Control messages go through a gloo group even when gradients go through NCCL: they are CPU
numbers the host needs at once, and a gloo all-reduce does not wait for the GPU's queue.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import sys

import torch
import torch.distributed as dist

log = logging.getLogger("hsstream.train")


class World:
    """One process, or one rank of ``torchrun`` (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``)."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0, ctrl=None, owned: bool = False) -> None:  # noqa: ANN001
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self._ctrl = ctrl  # gloo group for control messages (None: the default group)
        self._owned = owned

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_writer(self) -> bool:
        """The rank that writes checkpoints, logs metrics and the summary."""
        return self.rank == 0

    @staticmethod
    def env_size() -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    @staticmethod
    def env_local_rank() -> int | None:
        v = os.environ.get("LOCAL_RANK")
        return int(v) if v is not None else None

    @classmethod
    def from_env(cls, device: torch.device, timeout_s: float = 1800.0) -> World:
        """Join the process group torchrun describes in the environment (or be alone)."""
        size = cls.env_size()
        if size <= 1:
            return cls()
        if not faulthandler.is_enabled():
            # A rank killed by a native library (SIGABRT: "terminate called without an active
            # exception", seen now and then at the end of a two-rank gloo run, cause not yet
            # found) prints every thread's Python stack, so the report names where it was;
            # torchrun or mp.spawn alone say only which signal it was.
            faulthandler.enable()
        owned = False
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            kw = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
            owned = True
        ctrl = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        w = cls(dist.get_rank(), dist.get_world_size(), cls.env_local_rank() or 0, ctrl, owned)
        log.info("rank %d of %d (local %d) on %s, gradients over %s", w.rank, w.size, w.local_rank, device,
                 dist.get_backend())  # fmt: skip
        return w

    # -- control (CPU) --------------------------------------------------------------------------
    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (one gloo all-reduce); alone: the values themselves."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._ctrl)
        return t.tolist()

    def gather(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._ctrl)
        return out

    def broadcast(self, obj: object, src: int = 0) -> object:
        """Rank ``src``'s ``obj`` on every rank; a barrier too (every rank waits for ``src``)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._ctrl)
        return box[0]

    # -- device ---------------------------------------------------------------------------------
    def all_reduce_(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over ranks on the device's backend (the gradients)."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

    def broadcast_module_(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers everywhere: every rank starts from the same weights."""
        if not self.distributed:
            return
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)

    def close(self) -> None:
        """Leave the process group. After a clean run every rank first meets the others, so
        that no rank tears its connections down while a peer is still inside a collective on
        them (a peer's gloo transport then aborted the process now and then, after all the
        work was done). After an error there is no meeting: the others may be gone."""
        if self._owned and dist.is_initialized():
            if sys.exc_info()[0] is None:  # called from a ``finally`` without an exception in flight
                dist.monitored_barrier(group=self._ctrl)  # names a rank that never comes
            dist.destroy_process_group()
            self._owned = False


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    """``hsstream train --nproc N ...`` → the same command under torchrun, ``--nproc`` removed.

    ``--standalone``: a rendezvous on this host on a free port, nothing to configure.
    """
    rest: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        rest.append(a)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
            "hsstream", *rest]  # fmt: skip
