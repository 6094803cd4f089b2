"""Admitting a job: the limits on its size, and the worker thread that does the work.

Tokenising a job and writing its rows take time in proportion to its size; on the event loop
they would hold up every other request, the health probes included. They run on one worker
thread instead: one, because a tokenizer is not made to be shared by threads (a fast tokenizer
raises "Already borrowed" when two use it at once), and jobs are admitted in the order they came.
The size limits bound what one request can cost before any of that work starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import HTTPException

from connector.contract.settings import Settings

T = TypeVar("T")


def too_many_samples(n: int | None, s: Settings) -> HTTPException:
    """``n`` None: an upload read no further than the limit."""
    count = n if n is not None else f"more than {s.max_job_samples}"
    return HTTPException(413, f"the job has {count} samples; the limit is {s.max_job_samples} per job "
                              "(HSSTREAM_MAX_JOB_SAMPLES): split it into several jobs")  # fmt: skip


def check_job_size(n_samples: int, epochs: int, s: Settings) -> None:
    """413 naming the limit and its setting when a job is larger than one request may be."""
    if n_samples > s.max_job_samples:
        raise too_many_samples(n_samples, s)
    if n_samples * epochs > s.max_job_rows:
        raise HTTPException(413, f"the job has {n_samples} samples x {epochs} epochs = {n_samples * epochs} rows; "
                                 f"the limit is {s.max_job_rows} per job (HSSTREAM_MAX_JOB_ROWS): "
                                 "use fewer epochs or split the job")  # fmt: skip


class Admitter:
    """The one worker thread jobs are tokenised and written on."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hsstream-admit")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
