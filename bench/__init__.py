"""Benchmarks and the long checks; results in ``bench/results/``."""

from __future__ import annotations


def cpu_model() -> str:
    """The processor's model name from ``/proc/cpuinfo`` ("" where there is none): figures that
    ride on memory bandwidth differ from host to host, so each result file names its host's."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def rank_pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``: the value at rank ``int(q * n)`` of the sorted list
    (the last for q near 1), rounded to 3 places."""
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)
