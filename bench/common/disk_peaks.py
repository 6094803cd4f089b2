"""Peak bytes on disk while a study runs: a thread polls directory sizes and keeps each peak.

Shared by the online-vs-offline study and the vs-speculators study (numpy- and torch-free, so
a study's parent process stays light)."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 if it does not exist); files vanishing
    while walked count as gone."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                continue
    return total


class PeakSampler:
    """Polls directory sizes every ``period_s``, keeps the peak of each (and of their sum); a
    context manager (the last sample is taken on exit)."""

    def __init__(self, dirs: dict[str, Path], period_s: float = 0.5) -> None:
        self.dirs = dirs
        self.period_s = period_s
        self.peak = {k: 0 for k in dirs}
        self.peak_sum = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name=f"{type(self).__name__.lower()}")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def sample(self) -> dict[str, int]:
        now = {k: tree_bytes(p) for k, p in self.dirs.items()}
        for k, v in now.items():
            self.peak[k] = max(self.peak[k], v)
        self.peak_sum = max(self.peak_sum, sum(now.values()))
        return now

    def __enter__(self) -> PeakSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.sample()
