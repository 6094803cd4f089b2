"""When to checkpoint, who writes, and what each rank acknowledges.

Crash consistency is the point. Samples are acknowledged to the sidecar only right after a
checkpoint that includes them is on disk (stream ``ack="manual"``, ``ack_through``). So after a
SIGKILL the sidecar hands back exactly the samples the newest checkpoint does not include, and
the resumed run trains on those and on nothing it already has. The one window left (killed
after writing a checkpoint, before its ack left) is closed by storing in the checkpoint the
keys it includes but had not acknowledged yet: the resumed run acknowledges those again
without training on them.

With several ranks: the ranks decide together (the same step, from numbers they all-reduced),
rank 0 writes the checkpoint with every rank's not-yet-acknowledged keys, broadcasts that it is
on disk, and only then each rank acknowledges its own keys on its own stream. Every save and
every ack is one line in ``OUT/checkpoint_log.jsonl`` (rank, pid, step, keys), which the tests
read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from connector import protocol as P
from trainer_client.train.data_path import HostBatch
from trainer_client.train.distributed import World

CKPT_LOG = "checkpoint_log.jsonl"


def append_line(path: Path, record: dict) -> None:
    """One JSON line, one ``write`` on an O_APPEND descriptor: lines from several ranks never mix."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


class CheckpointPolicy:
    """Pending keys since the last acknowledgement, and the checkpoint-then-ack sequence."""

    def __init__(self, out: Path, checkpoint_every: int, world: World, skip_keys: set[str] | None = None) -> None:
        self.out = out
        self.every = checkpoint_every
        self.world = world
        self.skip_keys: set[str] = set(skip_keys or ())  # in the resumed weights, maybe never acknowledged
        self.pending: list[P.SampleKey] = []  # yielded into a consumed batch since the last ack, in order
        self.trained_pending: list[str] = []  # of those, trained (or settled: in the weights already)
        self.last_step: int | None = None  # the step of the newest checkpoint this run wrote
        self.last_path: Path | None = None

    def already_trained(self, key: str) -> bool:
        return key in self.skip_keys

    def used(self, b: HostBatch) -> None:
        """A batch went into a step (or was only settled keys): its keys wait for a checkpoint."""
        self.pending.extend(b.yielded)
        self.trained_pending.extend(b.settled)
        self.trained_pending.extend(b.keys)

    def due(self, step: int, stepped: bool, at_end: bool, drained: bool, global_pending: int) -> bool:
        """Same answer on every rank: all arguments are per-step numbers the ranks agreed on."""
        return global_pending > 0 and ((stepped and step % self.every == 0) or at_end or drained)

    def checkpoint(self, stream, step: int, save: Callable[[list[str]], Path]) -> Path:  # noqa: ANN001
        """Rank 0 saves (``save(unacked_keys)``); then every rank acknowledges its own pending keys."""
        settled = set().union(*(set(k) for k in self.world.gather(self.trained_pending)))
        keepalive = getattr(stream, "keepalive", None)  # leases must not lapse while we write
        if keepalive:
            keepalive()
        said: object
        if self.world.is_writer:
            try:
                path = save(sorted(settled | self.skip_keys))
                said = str(path)
                append_line(self.out / CKPT_LOG, {"event": "save", "rank": self.world.rank, "pid": os.getpid(),
                                                  "step": step, "path": path.name})  # fmt: skip
            except BaseException as e:
                said = ("error", repr(e)[:500])
                self.world.broadcast(said)  # the others must not wait, nor ack
                raise
        else:
            said = None
        said = self.world.broadcast(said)  # a barrier: nobody acks before the checkpoint is on disk
        if isinstance(said, tuple):
            raise RuntimeError(f"rank 0 could not write the checkpoint of step {step}: {said[1]}")
        path = Path(str(said))
        if keepalive:
            keepalive()
        if self.pending and hasattr(stream, "ack_through"):
            stream.ack_through(self.pending[-1])
            append_line(self.out / CKPT_LOG, {"event": "ack", "rank": self.world.rank, "pid": os.getpid(),
                                              "step": step, "keys": [str(k) for k in self.pending]})  # fmt: skip
        self.skip_keys -= settled
        self.pending, self.trained_pending = [], []
        self.last_step, self.last_path = step, path
        return path
