"""The supervisor's child processes: how they are started, watched, described and reaped.

A child runs in its own process group with a parent-death signal (no orphan vLLM if ``up``
is killed), its output is streamed and kept (:class:`Proc`: the last lines explain a death),
and what is left of a group whose leader died is stopped as a whole (:func:`reap_group`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from hsstream import launch


def _pdeathsig() -> Callable[[], None] | None:
    """preexec_fn: the child gets SIGTERM if ``up`` itself is killed (-9), so no orphan vLLM.

    Resolved before any fork: the child only makes one system call.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    PR_SET_PDEATHSIG = 1

    def _set() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return _set if sys.platform.startswith("linux") else None


PREEXEC = _pdeathsig()


class Proc(launch.Child):
    """A child whose output is streamed (prefixed) and kept: the last lines explain a death."""

    def __init__(
        self, name: str, proc: subprocess.Popen, log_path: Path | None, sink: Callable[[str, str], None] | None
    ) -> None:
        super().__init__(name, proc, log_path)
        self.lines: deque[str] = deque(maxlen=60)
        self.started = time.monotonic()
        self._sink = sink
        self._reader = threading.Thread(target=self._pump, name=f"up-log-{name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        out = open(self.log_path, "a", encoding="utf-8") if self.log_path else None  # noqa: SIM115
        try:
            assert self.proc.stdout is not None
            for raw in iter(self.proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self.lines.append(line)
                if out:
                    out.write(line + "\n")
                    out.flush()
                if self._sink:
                    self._sink(self.name, line)
        except (OSError, ValueError):
            pass
        finally:
            if out:
                out.close()

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def join_reader(self, timeout: float = 5.0) -> None:
        self._reader.join(timeout)
        if self.proc.stdout:
            self.proc.stdout.close()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def reap_group(pgid: int, grace_s: float = 10.0) -> None:
    """Stop what is left of a process group whose leader is gone: SIGTERM, a grace period, SIGKILL.

    vLLM's engine, workers and multiprocessing resource tracker outlive a killed API server.
    SIGTERM first, because the tracker unlinks the named semaphores and shared memory it
    tracks only if it is not killed itself (it ignores SIGTERM and exits once the others did).
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        time.sleep(0.1)
