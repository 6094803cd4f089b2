"""A stop asked for (SIGTERM, Ctrl-C) ends training at the next step boundary with a checkpoint of
every step trained, instead of wherever the signal happens to land.

Why: the loop checkpoints every N steps or seconds and acknowledges samples only after a
checkpoint holds them, so a stop that raised where it landed kept nothing since the newest
checkpoint (an H100 run cut at its deadline had trained 2,728 steps and kept step 2,396:
docs/gpu-plan.md, stop 49) and could land in the middle of an optimizer step. Here the first
signal only *asks*: the loop agrees on it across ranks in its per-step sum, checkpoints (and
acknowledges what it holds), then the stop goes on as it would have — the handler installed
before runs (``hsstream train``'s exit 0, Python's ``KeyboardInterrupt``, or the default action).

A stream that yields ``None`` when quiet (``HiddenStateStream(idle_s=...)``; ``hsstream train``
sets 0.2 s) hands the loop back within that time, so a stop is only flagged and the stream is
never interrupted (an exception raised into it could land between the frames of a message it
sends). A stream that blocks instead (no ``idle_s``) has its wait interrupted at once
(:class:`StopWhileWaiting`): a quiet stream must not hold a stop up. A sample pulled from the
stream but not yet in a step is not acknowledged, so the sidecar delivers it again: nothing is
lost. A second signal does not wait for anything.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("hsstream.train")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopWhileWaiting(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised into a wait for data by the first stop signal; the loop catches it around the wait."""


class GracefulStop:
    """The stop handlers for the length of one training loop (main thread only; elsewhere, and for
    a signal that was ignored before, nothing is installed and a stop acts as it did)."""

    def __init__(self, interrupt_waits: bool = True) -> None:
        self.asked: int | None = None  # the signal that asked, once one did
        self.interrupt_waits = interrupt_waits  # False: the stream yields when idle, the flag is enough
        self._prev: dict[int, object] = {}
        self._waiting = False

    def install(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                prev = signal.getsignal(s)
                if prev is signal.SIG_IGN:
                    continue
                self._prev[s] = prev
                signal.signal(s, self._ask)
        return self

    def close(self) -> None:
        """Puts the handlers back as they were."""
        for s, h in self._prev.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)  # type: ignore[arg-type]
        self._prev = {}

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait for data: a stop asked for in it interrupts it (:class:`StopWhileWaiting`)."""
        self._waiting = self.interrupt_waits
        try:
            if self.asked is not None and self.interrupt_waits:
                raise StopWhileWaiting
            yield
        finally:
            self._waiting = False

    def _ask(self, sig: int, frame: object) -> None:
        if self.asked is not None:  # the second: at once, as the handler before would
            log.warning("stop asked again (%s): stopping now", signal.Signals(sig).name)
            self.resume(sig)
            return
        self.asked = sig
        log.warning("stop asked (%s): stopping after this step with a checkpoint of every step trained; "
                    "send it again to stop at once", signal.Signals(sig).name)  # fmt: skip
        if self._waiting:
            raise StopWhileWaiting

    def resume(self, sig: int | None = None) -> None:
        """The stop goes on as the handler before this one would have taken it (it raises
        ``SystemExit``/``KeyboardInterrupt``, or the process ends with the signal's default)."""
        sig = sig if sig is not None else self.asked
        if sig is None:
            return
        prev = self._prev.get(sig, signal.SIG_DFL)
        self.close()
        if callable(prev):
            prev(sig, None)
            return
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
