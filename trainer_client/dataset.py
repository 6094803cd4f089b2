"""``torch.utils.data.IterableDataset`` over a sidecar's stream, for DataLoader workers and ranks.

Disjointness comes from the sidecar, not from sharding here: every stream is a separate peer
of the sidecar's delivery socket, and each sample is leased to exactly one peer. So the
dataset only has to make sure each DataLoader worker (and each rank) opens its *own* stream,
inside the process that iterates it: the dataset object itself holds nothing but settings,
and the ZeroMQ socket is created in ``__iter__``, after the fork, never shared across one.

Stopping together is the part ranks need help with: each rank's stream ends when the jobs
are complete, which happens at slightly different steps on different ranks, and a rank that
leaves the loop early leaves the others waiting in a collective. :func:`stop_together` makes
every rank run the same number of steps, handing ``None`` to ranks that ran dry until all
have.

Acknowledgement in workers is at use (when the worker moves on from a sample): the loop's
deferred ``ack_through`` cannot reach a socket owned by another process. A trainer that
needs deferred acks (checkpoint-consistent resume) iterates with ``num_workers=0``. Build
loaders with :func:`make_loader` (``in_order=False``, see there), and keep the loop's pace
within the sidecar's ``HSSTREAM_TRAINER_TIMEOUT_S``: a worker's stream sends heartbeats only
while the worker is fetching.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from trainer_client.stream import HiddenStateStream, Sample


class HiddenStateDataset(IterableDataset):
    """Samples from a sidecar; each worker / rank is its own consumer.

    ``transform`` runs in the worker (e.g. build training tensors there, off the main
    process). With ``num_workers=0`` the stream lives in the main process and ``ack``
    may be ``"manual"``; the open stream is then available as :attr:`stream` for
    ``ack_through``.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        jobs: list[str] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        credit: int = 4,
        ack: str = "use",
        follow: bool = False,
        timeout_s: float = 600.0,
        transform: Callable[[Sample], Any] | None = None,
        **stream_options: Any,
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.jobs = jobs
        self.spool_dir = str(spool_dir) if spool_dir is not None else None
        self.credit = credit
        self.ack = ack
        self.follow = follow
        self.timeout_s = timeout_s
        self.transform = transform
        self.stream_options = stream_options  # e.g. remote transport: curve_server_key, curve_client_cert
        self.stream: HiddenStateStream | None = None

    def __getstate__(self) -> dict:
        # What goes to a worker is settings only: never a live stream or socket.
        d = dict(self.__dict__)
        d["stream"] = None
        return d

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None and self.ack != "use":
            raise ValueError(
                "ack='manual' needs num_workers=0: a DataLoader worker owns its socket, the training loop cannot "
                "acknowledge through it"
            )
        stream = HiddenStateStream(
            self.endpoint, jobs=self.jobs, spool_dir=self.spool_dir, credit=self.credit, ack=self.ack,
            follow=self.follow, timeout_s=self.timeout_s, **self.stream_options,
        )  # fmt: skip
        self.stream = stream
        try:
            with stream:
                for smp in stream:
                    yield self.transform(smp) if self.transform is not None else smp
        finally:
            self.stream = None


def collate_samples(batch: list[Any]) -> list[Any]:
    """Keep samples as a list: they have different lengths, packing is the trainer's business."""
    return batch


def make_loader(dataset: HiddenStateDataset, batch_size: int | None = None, num_workers: int = 0, **kw: Any):  # noqa: ANN201
    """A DataLoader that cannot stall at the end of a job: batches are taken as workers finish them.

    With the default in-order fetching the loader waits for worker 0's next batch while
    worker 1, parked until asked, still holds leased samples (and the one it yielded last,
    acknowledged when it moves on). Near the end of a job worker 0 then waits for samples
    only worker 1 can release: nothing moves until the sidecar times worker 1 out and hands
    its samples to worker 0, which yields them a second time. ``in_order=False`` keeps every
    worker served, so the job completes and every worker's stream ends.
    """
    from torch.utils.data import DataLoader

    kw.setdefault("collate_fn", collate_samples if batch_size is not None else None)
    if num_workers > 0:
        kw.setdefault("in_order", False)
    return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, **kw)


def stop_together(iterable: Iterable[Any], group: Any = None, poll_s: float = 0.2) -> Iterator[Any | None]:
    """Yield items until *every* rank has run out; a rank without an item this step gets ``None``.

    All ranks take the same number of steps and leave the loop at the same step, so none is
    left waiting in a collective. A rank must not simply block for its next sample: the
    sidecar ends a job only when every sample is acknowledged, and the samples another rank
    still holds are acknowledged only when that rank moves on, which it does after the
    per-step all-reduce. So the iterable runs in a background thread (which then owns the
    stream and its socket) and each step waits at most ``poll_s`` for an item; a rank that
    has none yet yields ``None`` (the loop does an empty step) and the loop ends when every
    rank's iterable is exhausted. Without ``torch.distributed`` it is a plain pass-through.
    """
    import queue
    import threading

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield from iterable
        return
    q: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def pump() -> None:
        try:
            for item in iterable:
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(("end", None))
        except BaseException as e:  # noqa: BLE001 - re-raised in the training loop's thread
            q.put(("error", e))

    t = threading.Thread(target=pump, name="hsstream-stop-together", daemon=True)
    t.start()
    done = False
    try:
        while True:
            item = None
            if not done:
                try:
                    kind, val = q.get(timeout=poll_s)
                except queue.Empty:
                    kind, val = "wait", None
                if kind == "error":
                    raise val
                if kind == "end":
                    done = True
                elif kind == "item":
                    item = val
            flag = torch.tensor([0 if done else 1], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
            if int(flag.item()) == 0:
                return
            yield item
    finally:
        stop.set()
