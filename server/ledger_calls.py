"""Ledger calls from the event loop that never wait for the ledger's lock there.

The ledger's lock is held by the notices and delivery threads for a whole group of moves and
its commit (``server/ledger/core.py``). A coroutine that waits for it on the event loop stops
every other request meanwhile, the health probes included (a flood of trainer messages once
held ``/healthz`` for 4.5 s). :func:`ledger_call` takes the lock without waiting: when it is free,
as it nearly always is, the call runs at once on the loop (no thread hop, which at hundreds of
samples a second the submitter would feel); when another thread holds it, the call goes to a
worker thread and the loop serves others until it returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from server.ledger import Ledger

T = TypeVar("T")


async def ledger_call(ledger: Ledger, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` (which takes the ledger's lock) without the event loop waiting for the lock."""
    if ledger.try_lock():
        try:
            return fn(*args)
        finally:
            ledger.unlock()
    return await asyncio.to_thread(fn, *args)
