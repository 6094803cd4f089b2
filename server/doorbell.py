"""A thread's doorbell: other threads ring it, its owner sleeps in ``zmq.Poller`` on it.

The delivery thread sleeps in a poll on its sockets; a sample made READY on another thread (a
notice committed on the notices thread, vLLM's reply on the submitter's) would otherwise wait
for the poll's timeout or for some trainer's message before it is offered. A pipe, since the
ringing threads may not touch the delivery thread's sockets; ringing one that is closed, or
full (wake-ups already pending), does nothing.
"""

from __future__ import annotations

import os
import threading


class Doorbell:
    def __init__(self) -> None:
        self._r = self._w = -1
        self._lock = threading.Lock()  # the write end is never written after it is closed

    def open(self) -> int:
        """Make the pipe (by the owner, before it polls); returns the end to poll."""
        r, w = os.pipe()
        for fd in (r, w):
            os.set_blocking(fd, False)
        with self._lock:
            self._r, self._w = r, w
        return r

    @property
    def is_open(self) -> bool:
        return self._w >= 0

    def fileno(self) -> int:
        return self._r

    def ring(self) -> None:
        """Wake the owner (any thread; a no-op while the bell is closed)."""
        with self._lock:
            if self._w < 0:
                return
            try:
                os.write(self._w, b"x")
            except BlockingIOError:  # the pipe is full: the owner has wake-ups pending anyway
                pass

    def drain(self) -> None:
        """The owner heard it: take the pending rings."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            for fd in (self._r, self._w):
                if fd >= 0:
                    os.close(fd)
            self._r = self._w = -1
