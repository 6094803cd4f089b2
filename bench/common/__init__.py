"""What the studies share (issue 42, item 5): one place for the figures every study reads alike.

Here: the nearest-rank percentile of the latency tables (:func:`pctl`), the soak and fuzz runs'
rank convention (:func:`rank_value`, :func:`rank_pct`), the steady-state window of a run's times
(:func:`window_bounds`) and the host's CPU model (:func:`cpu_model`); ``disk_peaks.py``: peak
bytes on disk while a study runs. Nothing here measures or writes a result; pure and light (no
numpy, no torch), so a study's parent process stays light.
"""

from __future__ import annotations

import math


def cpu_model() -> str:
    """The processor's model name from ``/proc/cpuinfo`` ("" where there is none): figures that
    ride on memory bandwidth differ from host to host, so each result file names its host's."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def rank_value(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``: the value at rank ``int(q * n)`` of the sorted list
    (the last for q near 1). The soak and fuzz runs' convention (:func:`pctl` is the latency tables')."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def rank_pct(xs: list[float], q: float) -> float:
    """:func:`rank_value` rounded to 3 places."""
    return round(rank_value(xs, q), 3)


def window_bounds(ts: list[float], lo: float = 0.10, hi: float = 0.90) -> tuple[float, float]:
    """The steady-state window of times ``ts``: from the ``lo`` to the ``hi`` fraction of them
    (floor and ceiling on the (n - 1) scale), as every "window" figure in docs/benchmarks.md."""
    s = sorted(ts)
    return s[math.floor(lo * (len(s) - 1))], s[math.ceil(hi * (len(s) - 1))]


def pctl(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``xs``, nearest rank on the (n - 1) scale (p50 of two values is
    the second, p99 of 100 the 99th); None if empty. Every latency table in docs/benchmarks.md
    since the arena bench is read with this one (the benches each had their own copy)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]
