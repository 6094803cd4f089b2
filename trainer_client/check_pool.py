"""A small bounded pool that reads and checks delivered samples off the socket's thread.

Why: the connector's writer threads finish a prefill batch's samples in a burst (~16 at once
on an H200), and reading + checking one 33.5 MB sample takes ~13 ms. Done one after another
on the stream's only thread, the 16th waits ~200 ms. The work is file reads, blake3 and numpy
scans, all of which release the GIL, so a few threads overlap it.

The rule of :class:`~trainer_client.stream.HiddenStateStream` stays: one thread owns the
ZeroMQ socket. Workers only run the job they are given and never see the socket; the owner
submits, learns through :meth:`CheckPool.fileno` (a pipe it polls next to the socket) that a
job finished, and takes results back with :meth:`CheckPool.pop`, then sends FAIL/RECEIVED/CREDIT
itself. ``ordered``: results come back in submission order (a finished job waits for older
ones); otherwise as they finish, so a quick sample is not held behind a slow one (the samples
of one vLLM batch arrive together; side by side on the H200 host, keeping the order cost
0.7 ms p50 / 3 ms p99 of the notice-to-GPU latency, docs/benchmarks.md).

Bounded: at most ``limit`` jobs are held (queued, running or finished but not popped) and at
most ``workers`` run at once. ``workers=0`` runs each job inline in :meth:`submit` (the
stream's serial behaviour before the pool).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

#: Thread names of the workers (tests check that none outlives :meth:`CheckPool.close`).
THREAD_PREFIX = "hsstream-check"


class PoolFull(RuntimeError):
    pass


class CheckPool:
    def __init__(self, workers: int, limit: int, *, ordered: bool = True) -> None:
        if workers < 0 or limit < 1:
            raise ValueError(f"workers must be >= 0 and limit >= 1 (got {workers}, {limit})")
        self.workers = workers
        self.limit = limit
        self.ordered = ordered
        self._jobs: deque[tuple[Any, Future]] = deque()
        self._executor: ThreadPoolExecutor | None = None
        self._rfd = self._wfd = -1
        self._lock = threading.Lock()
        self.running = 0  # jobs executing now
        self.max_running = 0  # the most that ever ran at once
        self.max_held = 0  # the most jobs ever held at once

    # -- owner's side ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def full(self) -> bool:
        return len(self._jobs) >= self.limit

    def submit(self, tag: Any, fn: Callable[..., Any], *args: Any) -> Future:  # noqa: ANN401
        """Queue ``fn(*args)``; ``tag`` comes back with its result. Refuses beyond ``limit``."""
        if self.full:
            raise PoolFull(f"{len(self._jobs)} jobs held (limit {self.limit})")
        if self.workers == 0:
            fut: Future = Future()
            try:
                fut.set_result(self._run(fn, *args))
            except Exception as e:  # noqa: BLE001 - handed to the owner with the result, as from a worker
                fut.set_exception(e)
        else:
            if self._executor is None:
                self._rfd, self._wfd = os.pipe()
                os.set_blocking(self._rfd, False)
                os.set_blocking(self._wfd, False)
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=THREAD_PREFIX)
            fut = self._executor.submit(self._run, fn, *args)
            fut.add_done_callback(self._wake)
        self._jobs.append((tag, fut))
        self.max_held = max(self.max_held, len(self._jobs))
        return fut

    def has_result(self) -> bool:
        """A result may be popped: the oldest job has finished (``ordered``), or any job has."""
        return self._next_done() is not None

    def _next_done(self) -> int | None:
        if not self._jobs:
            return None
        if self.ordered:
            return 0 if self._jobs[0][1].done() else None
        return next((i for i, (_, f) in enumerate(self._jobs) if f.done()), None)

    def pop(self) -> tuple[Any, Future]:
        """A finished job: (tag, future), the oldest one that may go. Call only when
        :meth:`has_result`."""
        i = self._next_done()
        if i is None:
            raise RuntimeError("the oldest job has not finished" if self.ordered else "no job has finished")
        if i == 0:
            return self._jobs.popleft()
        job = self._jobs[i]
        del self._jobs[i]
        return job

    def wait_for(self, fut: Future, timeout: float | None = None) -> None:
        wait_futures([fut], timeout)

    def fileno(self) -> int:
        """Readable when a job finished since the last :meth:`clear_wakeups` (-1: no workers)."""
        return self._rfd

    def clear_wakeups(self) -> None:
        if self._rfd >= 0:
            try:
                while os.read(self._rfd, 4096):
                    pass
            except BlockingIOError:
                pass

    def tags(self) -> list[Any]:
        return [t for t, _ in self._jobs]

    def held(self) -> list[tuple[Any, Future]]:
        """The jobs not yet popped, (tag, future), oldest first."""
        return list(self._jobs)

    def close(self) -> list[tuple[Any, Future]]:
        """Let every held job finish, stop the workers and return the jobs not yet popped, in
        order, for the owner to settle (nothing is dropped: a job that read a file has to have
        its file removed and its RECEIVED sent by the owner)."""
        jobs = list(self._jobs)
        self._jobs.clear()
        wait_futures([f for _, f in jobs])
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for fd in (self._rfd, self._wfd):
            if fd >= 0:
                os.close(fd)
        self._rfd = self._wfd = -1
        return jobs

    # -- workers' side ---------------------------------------------------------------------------
    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:  # noqa: ANN401
        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.running -= 1

    def _wake(self, _fut: Future) -> None:
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):  # pipe full (the owner will look anyway) or closed at close()
            pass
