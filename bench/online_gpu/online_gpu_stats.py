"""``bench/online_gpu/online_gpu.py``'s measurements: steady-state rates, percentiles, where latency goes.

Pure functions of what the consumers recorded (and of vLLM's log), apart from the processes
that produce the records, so they are unit-tested on records written by hand
(``tests/unit/bench/test_online_gpu_breakdown.py``); :class:`SpoolWatch` polls the spool.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import threading
from pathlib import Path

from bench.common import pctl as pct
from bench.common import window_bounds

WINDOW = (0.10, 0.90)
#: A job's first samples, whose p99 shows what its start costs (the stall the window leaves out).
FIRST = 32
_KV_RE = re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens")


def window_rate(times: list[float], tokens_each: int, lo: float = WINDOW[0], hi: float = WINDOW[1]) -> dict:
    """Tokens/s between the ``lo`` and ``hi`` quantiles of completion times (steady state)."""
    t = sorted(times)
    n = len(t)
    if n < 4:
        return {"tok_per_s": None, "samples": n, "why": "fewer than 4 completions"}
    i, j = int(math.floor(lo * (n - 1))), int(math.ceil(hi * (n - 1)))
    dt = t[j] - t[i]
    if dt <= 0:
        return {"tok_per_s": None, "samples": n, "why": "no time between the window's ends"}
    return {"tok_per_s": round((j - i) * tokens_each / dt, 1), "samples_per_s": round((j - i) / dt, 2),
            "window": [lo, hi], "window_samples": j - i, "window_s": round(dt, 3), "samples": n,
            "overall_tok_per_s": round(n * tokens_each / (t[-1] - t[0]), 1) if t[-1] > t[0] else None}  # fmt: skip




def latency(recs: list[dict], first: int = FIRST) -> dict:
    """Notice -> sample on the GPU (ms) of one job's records, three ways, each named: ``p50`` /
    ``p99`` / ``max`` over the steady-state window (samples on the GPU between the 10th and 90th
    percentile of delivery times, as the rates), ``all`` over every delivered sample, ``first_32``
    over the job's first ``first`` samples by notice time (its start); and ``samples_ms``, every
    sample's latency in notice order, so any other cut can be taken from the JSON later."""
    xs = sorted((x for x in recs if x.get("sent") is not None), key=lambda x: x["sent"])
    lat_all = [1000 * (x["g"] - x["sent"]) for x in xs]
    lo_t, hi_t = window_bounds([x["g"] for x in recs], *WINDOW) if recs else (0.0, 0.0)
    lat = [1000 * (x["g"] - x["sent"]) for x in xs if lo_t <= x["g"] <= hi_t]
    head = lat_all[:first]

    def three(v: list[float]) -> dict:
        return {"p50": rounded(pct(v, 0.5)), "p99": rounded(pct(v, 0.99)), "max": rounded(max(v) if v else None),
                "n": len(v)}  # fmt: skip

    return {**three(lat), "window": list(WINDOW), "all": three(lat_all), f"first_{first}": three(head),
            "samples_ms": [round(v, 2) for v in lat_all]}


def kv_tokens(log_path: Path) -> list[int]:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [int(m.replace(",", "")) for m in _KV_RE.findall(text)]


class SpoolWatch:
    """Peak bytes on the spool (files and temp files), polled; the budget is the sidecar's."""

    def __init__(self, spool: Path, every_s: float = 0.02) -> None:
        self.spool, self.every_s = spool, every_s
        self.peak = self.peak_files = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = n = 0
            try:
                with os.scandir(self.spool) as it:
                    for e in it:
                        try:
                            total += e.stat(follow_symlinks=False).st_size
                            n += 1
                        except OSError:
                            pass
            except OSError:
                pass
            self.peak, self.peak_files = max(self.peak, total), max(self.peak_files, n)
            self._stop.wait(self.every_s)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join(2)
        return {"peak_bytes": self.peak, "peak_files": self.peak_files}


def rounded(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


#: The connector's stages from the engine's step to the notice, in order (``Notice.timings``):
#: their sum plus notice -> GPU is the sample's time from the end of its forward pass to the
#: trainer's GPU (``forward_end_to_gpu``; the gather is enqueued by the step right after it).
FORWARD_END_STAGES = ("gather", "queue", "copy_wait", "checksum", "write")


def breakdown(recs: list[dict]) -> dict:
    """Mean, p50 and p99 ms per sample of each stage, from the notices' connector timings and
    the stream's per-sample stamps (``Sample.timings``, one host clock with ``sent_at``):

    * ``sidecar``: notice sent -> the delivery read off the trainer's socket (the sidecar's
      ledger and delivery, and credit: a sample waits here while the stream holds ``credit``),
      in parts: ``sidecar_in`` (to the sidecar's notice socket), ``sidecar_queue`` (applied,
      committed, woken, credit, leased, sent), ``sidecar_to_trainer`` (read off the trainer's socket);
    * ``pool_queue``: received -> a check worker starts on it (all workers busy);
    * ``check`` = ``alloc`` + ``read`` + ``checksum`` + ``finite`` (host) or ``to_device`` (copy
      and finiteness on the GPU with ``--finite-on-device``) + small checks;
    * ``in_order``: checked -> handed to the loop (with ``--ordered``, older samples first; always the
      socket thread's own work: a 33.5 MB tmpfs unlink took ~4 ms there until files were deleted aside);
    * ``copy_to_trainer_gpu``: handed -> on the GPU (a no-op copy with ``--finite-on-device``);
    * ``forward_end_to_gpu``: the connector's stages (:data:`FORWARD_END_STAGES`) + notice -> GPU.
    """
    stages: dict[str, list[float]] = {}

    def add(k: str, v: float | None) -> None:
        if v is not None:
            stages.setdefault(k, []).append(1000 * v)

    for x in recs:
        conn = x.get("conn") or {}
        for k, v in conn.items():
            add(k if k.startswith("sidecar_") else f"connector_{k}", v)
        t = x.get("stream") or {}
        if x.get("sent") is not None and "received" in t:
            add("sidecar", t["received"] - x["sent"])
            if {"sidecar_in", "sidecar_queue"} <= set(conn):
                add("sidecar_to_trainer", t["received"] - x["sent"] - conn["sidecar_in"] - conn["sidecar_queue"])
        if {"received", "started", "checked", "handed"} <= set(t):
            add("pool_queue", t["started"] - t["received"])
            add("check", t["checked"] - t["started"])
            add("in_order", t["handed"] - t["checked"])
        for k in ("alloc_s", "read_s", "checksum_s", "finite_s", "to_device_s"):
            add(f"check_{k[:-2]}", t.get(k))
        if x.get("g") is not None:
            add("copy_to_trainer_gpu", x["g"] - x["y"])
            if x.get("sent") is not None and set(FORWARD_END_STAGES) <= set(conn):
                add("forward_end_to_gpu", sum(conn[k] for k in FORWARD_END_STAGES) + x["g"] - x["sent"])
    return {k: {"mean_ms": round(statistics.mean(v), 3), "p50_ms": round(statistics.median(v), 3),
                "p99_ms": round(pct(v, 0.99), 3)} for k, v in stages.items()}  # fmt: skip


def timeline(recs: list[dict], submitted_at: float, accepted_at: float, opened_at: float, parts: int = 10) -> dict:
    """Where the job's start goes and how latency moves through the job: seconds from the job's
    POST to the sidecar's answer, to the consumer's stream opening, to the first notice, the
    first delivery read and the first sample on the GPU; then, by notice order in ``parts``
    equal slices, each slice's first notice (s after the first) and its p50 / max latency and
    sidecar wait (ms). A backlog at the start shows as slow early slices."""
    xs = sorted((x for x in recs if x.get("sent") is not None), key=lambda x: x["sent"])
    if not xs:
        return {}
    t_first = xs[0]["sent"]
    rec_t = [x["stream"]["received"] for x in xs if "received" in (x.get("stream") or {})]
    start = {"sidecar_answered_s": accepted_at - submitted_at,
             "stream_opened_s": opened_at - submitted_at if math.isfinite(opened_at) else None,
             "first_notice_s": t_first - submitted_at,
             "first_received_s": (min(rec_t) - submitted_at) if rec_t else None,
             "first_on_gpu_s": min(x["g"] for x in xs) - submitted_at}
    out = []
    n = len(xs)
    for i in range(parts):
        part = xs[i * n // parts : (i + 1) * n // parts]
        if not part:
            continue
        lat = [1000 * (x["g"] - x["sent"]) for x in part]
        side = [1000 * (x["stream"]["received"] - x["sent"]) for x in part if "received" in (x.get("stream") or {})]
        out.append({"from_s": part[0]["sent"] - t_first, "n": len(part), "latency_p50_ms": rounded(pct(lat, 0.5)),
                    "latency_max_ms": rounded(max(lat)), "sidecar_p50_ms": rounded(pct(side, 0.5)) if side else None,
                    "sidecar_max_ms": rounded(max(side)) if side else None})  # fmt: skip
    return {"start_s": {k: rounded(v, 3) if v is not None else None for k, v in start.items()}, "by_notice_order": out}


def floor_ms(run: dict) -> float | None:
    """The faster of the two measured ways to get one sample from tmpfs onto the GPU, alone (the
    parts read at once, or safetensors' map + torch's multi-threaded copy into pinned memory):
    which wins depends on the host."""
    f = run.get("floor") or {}
    ways = [v for v in (f.get("total_parallel_read_ms_p50"), f.get("total_ms_p50")) if v is not None]
    return min(ways) if ways else None
