"""Which vLLM engine serves new requests: the live one, and the ones draining after a swap.

All on the proxy's event loop (no lock): a request takes the live engine when it starts
(:meth:`Upstreams.acquire`) and keeps it to its end, so a swap (:meth:`Upstreams.switch`)
moves only new requests to the new engine while the old one finishes what it has; once its
count is 0 it is drained (:meth:`Upstreams.wait_drained`) and may be stopped. Each engine
carries the version of the draft it serves, shown in ``/metrics`` and ``/admin/state``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Upstream:
    url: str
    version: str
    draft: str | None = None  # the draft dir it serves (managed engines, and the record)
    in_flight: int = 0
    since: float = field(default_factory=time.time)
    handle: Any = None  # the engine process when the proxy started it (managed mode)
    _idle: asyncio.Event | None = None

    def describe(self) -> dict:
        return {"url": self.url, "version": self.version, "draft": self.draft, "in_flight": self.in_flight,
                "since": self.since, "managed": self.handle is not None}  # fmt: skip


class Upstreams:
    def __init__(self, live: Upstream, metrics: Any = None) -> None:  # noqa: ANN401
        self.live = live
        self.draining: list[Upstream] = []
        self.history: list[dict] = []  # every live version, oldest first (rollback walks it back)
        self._m = metrics
        self._record(live)
        self._gauge(live, 1)

    def _gauge(self, u: Upstream, value: float) -> None:
        if self._m is not None:
            self._m.draft.labels(u.version, u.url).set(value)

    def _record(self, u: Upstream) -> None:
        self.history.append({"version": u.version, "url": u.url, "draft": u.draft, "since": u.since})

    def acquire(self) -> Upstream:
        u = self.live
        u.in_flight += 1
        if self._m is not None:
            self._m.in_flight.labels(u.version).inc()
        return u

    def release(self, u: Upstream) -> None:
        u.in_flight -= 1
        if self._m is not None:
            self._m.in_flight.labels(u.version).dec()
        if u.in_flight == 0 and u._idle is not None:
            u._idle.set()

    def switch(self, new: Upstream) -> Upstream:
        """Make ``new`` live for every request from now on; the old one drains."""
        old, self.live = self.live, new
        new.since = time.time()
        self._record(new)
        self._gauge(new, 1)
        if old is not new:
            self.draining.append(old)
            self._gauge(old, 0)
        return old

    async def wait_drained(self, u: Upstream, timeout_s: float) -> bool:
        """True once ``u`` holds no request (it then leaves the draining list and the gauges)."""
        if u.in_flight:
            u._idle = asyncio.Event()
            try:
                await asyncio.wait_for(u._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                return False
        if u in self.draining:
            self.draining.remove(u)
        if self._m is not None and u is not self.live:
            try:
                self._m.draft.remove(u.version, u.url)
                if all(x.version != u.version for x in [self.live, *self.draining]):
                    self._m.in_flight.remove(u.version)
            except KeyError:
                pass
        return True

    def previous(self) -> dict | None:
        """The version live before the current one (what a rollback goes back to)."""
        cur = self.live.version
        for h in reversed(self.history[:-1]):
            if h["version"] != cur:
                return h
        return None

    def state(self) -> dict:
        return {"live": self.live.describe(), "draining": [u.describe() for u in self.draining],
                "history": self.history[-20:]}  # fmt: skip
