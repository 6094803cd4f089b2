"""Running a real Submitter against fake engines for a while, shared by its unit tests
(test_engines.py, test_sidecar_limits.py): the submitter is always stopped, whatever the
test body raises, so no background task outlives its event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from server.submitter import Submitter


@asynccontextmanager
async def started(sub: Submitter) -> AsyncIterator[Submitter]:
    await sub.start()
    try:
        yield sub
    finally:
        await sub.stop()


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    t0 = asyncio.get_running_loop().time()
    while not cond():
        assert asyncio.get_running_loop().time() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.01)


async def run_until(sub: Submitter, cond: Callable[[], bool], timeout: float = 5.0) -> None:
    async with started(sub):
        await wait_until(cond, timeout)


async def run_for(sub: Submitter, seconds: float) -> None:
    async with started(sub):
        await asyncio.sleep(seconds)


async def probe(sub: Submitter) -> int | None:
    """The engine limit the started submitter learns from its engines' /v1/models."""
    async with started(sub):
        return await sub.probe_engine()
