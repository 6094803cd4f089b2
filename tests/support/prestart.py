"""Engines started one module ahead, in the background, while the module before runs.

An engine start (vLLM's CPU build + our sidecar) is ~25 s here, mostly one core importing vLLM in
fresh processes, while the other core sits idle; the integration modules start ~25 of them one after
the other. A module that lists what it starts in a module-level ``PRESTART`` (key -> (start, stop),
zero-argument ``start``) has its first one started while the module before it runs, the rest one by
one while it runs itself: at most one started engine waits untaken at any time, so memory stays at one
engine more than a plain run. The module's fixture takes its engine with
``tests.conftest.prestarted(__name__, key)`` (a stack: ``stack = stack_fixture(__name__)`` of
``tests/integration/conftest.py``): the started one, or (never prestarted,
``HSSTREAM_TEST_PRESTART=0``, or not reached yet) one it starts itself, as before. A start that failed
in the background raises in the fixture that takes it. What a test proves does not change: the same
start function makes the same stack, only earlier; its children start from the environment the
session began with (``base_env``), not from whatever a running test has monkeypatched since.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Entry:
    name: str  # "<module>::<key>"
    module: int  # the module's place in the run
    start: Callable[[], Any]
    stop: Callable[[Any], None]
    state: str = "pending"  # pending -> starting -> ready -> taken | dropped; pending -> taken (the fixture starts it)
    value: Any = None
    error: BaseException | None = None


class Prestarts:
    """The run's prestartable engines in run order, and the one thread that starts them."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = {e.name: e for e in entries}
        self._order = entries
        self._cv = threading.Condition()
        self._running = False  # set by the first test call: its fixtures (the tiny verifier's build) are done
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="prestart", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for e in self._order:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or (self._running and not self._waiting()))
                if self._closing:
                    return
                if e.state != "pending":
                    continue
                e.state = "starting"
            try:
                value, error = e.start(), None
            except BaseException as exc:  # noqa: BLE001 - raised again by the fixture that takes it
                value, error = None, exc
            with self._cv:
                e.value, e.error, e.state = value, error, "ready"
                self._cv.notify_all()
        # Stay until closed: `hsstream up`'s children ask for SIGTERM when the thread that started
        # them ends (PR_SET_PDEATHSIG is per thread), so the last engine started would die with it.
        with self._cv:
            self._cv.wait_for(lambda: self._closing)

    def _waiting(self) -> bool:
        return any(e.state == "ready" for e in self._order)

    def reached(self, module: int) -> None:
        """A test of the module at place ``module`` is about to run: the thread may start, and an
        engine of a module already passed (its tests deselected or skipped) is stopped, not kept."""
        stale = []
        with self._cv:
            self._running = True
            for e in self._order:
                if e.module < module and e.state in ("pending", "ready"):
                    if e.state == "ready" and e.error is None:
                        stale.append(e)
                    e.state = "dropped"
            self._cv.notify_all()
        for e in stale:
            e.stop(e.value)

    def take(self, name: str, start: Callable[[], Any]) -> Any:
        """The engine ``name`` names: the started one (waiting for a start under way), else started now."""
        with self._cv:
            e = self.entries.get(name)
            if e is None or e.state in ("pending", "dropped", "taken"):
                if e is not None:
                    e.state = "taken"
                    self._cv.notify_all()
                own = True
            else:
                self._cv.wait_for(lambda: e.state == "ready")
                e.state, own = "taken", False
                self._cv.notify_all()
        if own:
            return start()
        if e.error is not None:
            raise e.error
        return e.value

    def close(self) -> None:
        """Stop the thread (after a start under way) and every engine started and never taken."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        for e in self._order:
            if e.state == "ready" and e.error is None:
                e.state = "dropped"
                e.stop(e.value)
