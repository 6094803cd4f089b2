#!/usr/bin/env python3
"""What bf16 costs on this CPU: one matmul of a SmolLM2-sized layer (tokens x 576 @ 576 x 1536),
float32 against bfloat16, on one core, interleaved rounds; the CPU's bf16 flags beside it.

Why it exists: ``hsstream.launch.cpu_serving_dtype`` serves a bf16 checkpoint in float32 on a CPU
without bf16 instructions. This is the measurement behind that rule (docs/deploy.md).

    python bench/costs/cpu_dtype.py            # prints a table, writes bench/results/cpu_dtype.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=None, help="pin to this core (default: the last one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_dtype.json"))
    a = ap.parse_args()
    import torch

    from hsstream.amx import cpu_flags
    from hsstream.launch import BF16_FLAGS

    core = a.core if a.core is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    shapes = (a.tokens, 576, 1536)
    flops = 2 * shapes[0] * shapes[1] * shapes[2]
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    mats = {n: (torch.randn(shapes[0], shapes[1], dtype=getattr(torch, n)),
                torch.randn(shapes[1], shapes[2], dtype=getattr(torch, n))) for n in times}  # fmt: skip
    for x, w in mats.values():
        x @ w  # first call: allocations, kernel choice
    for _ in range(a.rounds):  # interleaved: a slow moment of the host hits both
        for n, (x, w) in mats.items():
            t0 = time.perf_counter()
            x @ w
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    flags = cpu_flags()
    res = {
        "what": "bench/costs/cpu_dtype.py: one tokens x 576 @ 576 x 1536 matmul on one core, float32 vs bfloat16",
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "core": core,
                    "bf16_flags": sorted(f for f in BF16_FLAGS if f in flags),
                    "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()},  # fmt: skip
        "tokens": a.tokens, "rounds": a.rounds,
        "ms": {n: [round(t * 1000, 2) for t in v] for n, v in times.items()},
        "median_ms": {n: round(v * 1000, 2) for n, v in med.items()},
        "gflops": {n: round(flops / v / 1e9, 2) for n, v in med.items()},
        "bf16_over_fp32": round(med["bfloat16"] / med["float32"], 1),
    }  # fmt: skip
    print(f"{'dtype':<10} {'median ms':>10} {'GFLOP/s':>8}   (bf16 flags: {res['machine']['bf16_flags'] or 'none'})")
    for n in times:
        print(f"{n:<10} {res['median_ms'][n]:>10} {res['gflops'][n]:>8}")
    print(f"bf16 / float32: {res['bf16_over_fp32']}x")
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
