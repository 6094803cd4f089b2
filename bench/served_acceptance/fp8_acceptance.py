#!/usr/bin/env python3
"""FP8 vs bf16 payloads: bytes per token, and the acceptance of the draft each trains.

Runs ``bench/served_acceptance/acceptance.py`` (the whole loop on the CPU demo: stream hidden states from vLLM,
train an Eagle-3 draft online, serve it in vLLM and count accepted draft tokens) once per arm
and seed, with ``HSSTREAM_PAYLOAD_DTYPE`` = ``model`` (the tiny verifier's bf16) or
``fp8_e4m3`` (connector/contract/payload.py). Arms alternate (bf16 s0, fp8 s0, bf16 s1, ...), so drift
of the shared machine's load falls on both alike; the seed is the trainer's (draft init and
order), data and evaluation prompts are the same for every run.

Pass: FP8's mean acceptance is within ``--tolerance`` (0.05) of bf16's at T=0 and at T=1, and
FP8 takes ≤ 0.55× bf16's bytes per token (scales included). Writes
bench/results/fp8_vs_bf16_acceptance.json.

    python bench/served_acceptance/fp8_acceptance.py                      # 3 seeds per arm, ~20 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.served_acceptance.acceptance import log, verdict, write_result  # noqa: E402

ARMS = ("model", "fp8_e4m3")


def spread(xs: list[float]) -> dict:
    return {"mean": round(statistics.fmean(xs), 4), "stdev": round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0,
            "min": round(min(xs), 4), "max": round(max(xs), 4), "runs": [round(x, 4) for x in xs]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train-samples", type=int, default=1200)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--max-bytes-ratio", type=float, default=0.55)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fp8_vs_bf16_acceptance.json"))
    a = ap.parse_args(argv)
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="hsstream-fp8-"))
    wd.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for seed in a.seeds:
        for arm in ARMS:
            out = wd / f"{arm}-seed{seed}.json"
            cmd = [sys.executable, str(ROOT / "bench" / "served_acceptance" / "acceptance.py"), "--payload-dtype", arm, "--seed", str(seed),
                   "--train-samples", str(a.train_samples), "--steps", str(a.steps), "--no-untrained",
                   "--workdir", str(wd / f"{arm}-seed{seed}"), "--out", str(out)]  # fmt: skip
            log(f"{arm} seed {seed}: " + " ".join(cmd[1:]))
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=1800)
            (wd / f"{arm}-seed{seed}.log").write_text(p.stdout + p.stderr)
            if not out.exists():
                log(f"run failed ({p.returncode}):\n" + "\n".join((p.stdout + p.stderr).splitlines()[-30:]))
                return 1
            r = json.loads(out.read_text())
            r["run_wall_s"] = round(time.perf_counter() - t0, 1)
            runs[arm].append(r)
            acc = r["acceptance"]["trained"]
            log(f"  T=0 {acc['T0']:.3f}  T=1 {acc['T1']:.3f}  {r['payload']['bytes_per_token']} B/token  "
                f"{r['run_wall_s']:.0f} s")  # fmt: skip

    def arm_summary(arm: str) -> dict:
        rs = runs[arm]
        return {
            "acceptance_T0": spread([r["acceptance"]["trained"]["T0"] for r in rs]),
            "acceptance_T1": spread([r["acceptance"]["trained"]["T1"] for r in rs]),
            "bytes_per_token": spread([r["payload"]["bytes_per_token"] for r in rs]),
            "top1_last_ttt_step": spread([r["training"]["top1"][-1] for r in rs]),
            "run_wall_s": [r["run_wall_s"] for r in rs],
        }

    bf16, fp8 = arm_summary("model"), arm_summary("fp8_e4m3")
    ratio = fp8["bytes_per_token"]["mean"] / bf16["bytes_per_token"]["mean"]
    d0 = fp8["acceptance_T0"]["mean"] - bf16["acceptance_T0"]["mean"]
    d1 = fp8["acceptance_T1"]["mean"] - bf16["acceptance_T1"]["mean"]
    checks = {
        f"fp8_bytes_per_token_le_{a.max_bytes_ratio}x_bf16": ratio <= a.max_bytes_ratio,
        f"fp8_mean_T0_within_{a.tolerance}_of_bf16": abs(d0) <= a.tolerance,
        f"fp8_mean_T1_within_{a.tolerance}_of_bf16": abs(d1) <= a.tolerance,
    }
    first = runs["model"][0]
    result = {
        "benchmark": "fp8_vs_bf16_acceptance_cpu",
        "command": "python bench/served_acceptance/fp8_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "per_run_command": "python bench/served_acceptance/acceptance.py --payload-dtype ARM --seed SEED "
                           f"--train-samples {a.train_samples} --steps {a.steps} --no-untrained",  # fmt: skip
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "verifier": first["verifier"]["path"],
        "seeds": a.seeds,
        "serving": {k: first["serving"][k] for k in ("num_speculative_tokens", "prompts", "max_tokens")},
        "bf16": bf16,
        "fp8_e4m3": fp8,
        "fp8_bytes_ratio": round(ratio, 4),
        "fp8_minus_bf16": {"T0": round(d0, 4), "T1": round(d1, 4)},
        "checks": checks,
        "passed": all(checks.values()),
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    write_result(result, a.out)
    print(f"\n{'payload':<10}{'B/token':>9}{'T=0 mean±sd':>16}{'T=1 mean±sd':>16}")
    for name, s in (("bf16", bf16), ("fp8_e4m3", fp8)):
        print(f"{name:<10}{s['bytes_per_token']['mean']:>9.1f}"
              f"{s['acceptance_T0']['mean']:>10.3f}±{s['acceptance_T0']['stdev']:.3f}"
              f"{s['acceptance_T1']['mean']:>10.3f}±{s['acceptance_T1']['stdev']:.3f}")  # fmt: skip
    print(f"fp8/bf16 bytes {ratio:.3f}; fp8 - bf16: T=0 {d0:+.3f}, T=1 {d1:+.3f} -> {a.out}")
    return verdict(checks)


if __name__ == "__main__":
    raise SystemExit(main())
