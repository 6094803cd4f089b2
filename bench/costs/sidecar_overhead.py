#!/usr/bin/env python3
"""Tokens/s through the sidecar vs the same prompts sent straight to vLLM, interleaved.

Both paths use the same running vLLM (CPU build here, with our connector) and the same
concurrency. "direct" is what a hand-rolled client does: POST each prompt to /v1/completions,
wait for its file, delete it. "sidecar" is the product: one REST job, a HiddenStateStream
consuming and validating every sample. Rounds alternate so both see the same machine noise.

Single rounds on a shared 2-core machine move by 10-30 % for both paths, so besides each round's
rate and its ratio to the direct round beside it, every sidecar round records what would show
real growth as jobs accumulate, independent of the machine's noise: the sidecar's and the
stream's CPU seconds per sample, the sidecar's RSS, open fds, threads, and its ledger's size on
disk. The trend of each over the rounds (least-squares slope, relative to the first round) is in
the JSON; ``--profile`` records the sidecar with py-spy during the first and the last sidecar
round and keeps both summaries.

    python bench/costs/sidecar_overhead.py --rounds 8 --n-prompts 512 --split 4   # tiny model, CPU
    python bench/costs/sidecar_overhead.py --rounds 8 --n-prompts 512 --profile   # where the sidecar's time goes

``--split K`` interleaves the two paths within each round, K parts each, so a burst of load on
the machine falls on both: a round's rate is what each path did over its K parts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from connector.protocol import lock_path_for  # noqa: E402


def prompts(n: int, plen: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 509) for _ in range(plen)] for _ in range(n)]


async def direct(vllm: str, ps: list[list[int]], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as c:
        model = (await c.get(f"{vllm}/v1/models")).json()["data"][0]["id"]

        async def one(p: list[int]) -> None:
            async with sem:
                r = await c.post(f"{vllm}/v1/completions", json={"model": model, "prompt": p, "max_tokens": 1})
                r.raise_for_status()
            path = r.json()["kv_transfer_params"]["hidden_states_path"]
            while not os.path.exists(path):  # the file lands after the response
                await asyncio.sleep(0.002)
            os.unlink(path)
            # The Example connector's contract: the reader removes the companion lock with the file.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path_for(path))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in ps))
        return time.perf_counter() - t0


def sidecar_proc(stack) -> psutil.Process:  # noqa: ANN001
    return psutil.Process(next(c for c in stack.children if c.name == "sidecar").proc.pid)


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def slope_rel(ys: list[float]) -> float | None:
    """Least-squares slope per round, relative to the fitted first round (0.0: flat)."""
    n = len(ys)
    if n < 2:
        return None
    xm, ym = (n - 1) / 2, statistics.mean(ys)
    b = sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / sum((x - xm) ** 2 for x in range(n))
    first = ym - b * xm
    return round(b / first, 5) if first else None


class Spy:
    """py-spy recording the sidecar for one round (raw collapsed stacks)."""

    def __init__(self, pid: int, out: Path) -> None:
        import shutil
        import subprocess

        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent) + ":" + os.environ["PATH"])
        self.out = out
        self.proc = spy and subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--output", str(out),
             "--nonblocking", "--threads"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(1.0)

    def summary(self) -> dict | None:
        import signal

        from bench.costs.sidecar_throughput import profile_summary

        if not self.proc:
            return None
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)
        return profile_summary(self.out) if self.out.exists() and self.out.stat().st_size else None


def via_sidecar(stack, ps: list[list[int]]) -> float:
    from trainer_client import HiddenStateStream

    t0 = time.perf_counter()
    with stack.client() as api:
        job = api.create_job([{"token_ids": p} for p in ps]).job_id
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool,
                           credit=32, timeout_s=300) as s:  # fmt: skip
        n = sum(1 for _ in s)
    assert n == len(ps), (n, len(ps))
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--split", type=int, default=1, help="parts per round, the two paths alternating part by part")
    ap.add_argument("--profile", action="store_true", help="py-spy the sidecar in the first and the last round")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sidecar_overhead_cpu.json"))
    args = ap.parse_args()
    from hsstream import launch
    from hsstream.devstack import Stack
    from hsstream.tiny_model import build_tiny_verifier

    model = str(build_tiny_verifier())
    stack = Stack(model, [2, 6, 9, 12], Path(tempfile.mkdtemp(prefix="hsstream-bench-")))
    stack.env["HSSTREAM_MAX_CONCURRENCY"] = str(args.concurrency)
    rows = []
    profiles: dict = {}
    try:
        stack.start()
        vllm = f"http://127.0.0.1:{stack.vllm_port}"
        ntok = args.n_prompts * args.prompt_len
        # Warm up both paths with enough prompts to open every connection of the concurrency.
        warm = max(8, 2 * args.concurrency)
        asyncio.run(direct(vllm, prompts(warm, args.prompt_len, 99), args.concurrency))
        via_sidecar(stack, prompts(warm, args.prompt_len, 98))
        side = sidecar_proc(stack)
        me = psutil.Process()
        ledger = stack.run_dir / "ledger.sqlite"
        for r in range(args.rounds):
            ps = prompts(args.n_prompts, args.prompt_len, r)
            # --split K: the round's prompts in K parts, the paths alternating part by part, so
            # both see the same few seconds of the machine's load; a round's rate is over its parts.
            k = max(1, args.split)
            parts = [ps[i * len(ps) // k:(i + 1) * len(ps) // k] for i in range(k)]
            secs = {"direct": 0.0, "sidecar": 0.0}
            spy = Spy(side.pid, stack.run_dir / f"spy{r}.txt") if args.profile and r in (0, args.rounds - 1) else None
            cpu_side = cpu_stream = 0.0
            for i, part in enumerate(parts):
                for mode in (("direct", "sidecar") if (r + i) % 2 == 0 else ("sidecar", "direct")):
                    if mode == "direct":
                        secs[mode] += asyncio.run(direct(vllm, part, args.concurrency))
                    else:
                        c0, m0 = cpu_s(side), cpu_s(me)
                        secs[mode] += via_sidecar(stack, part)
                        cpu_side += cpu_s(side) - c0
                        cpu_stream += cpu_s(me) - m0
            if spy is not None:
                profiles["first" if r == 0 else "last"] = spy.summary()
            load = round(os.getloadavg()[0], 2)
            for mode in ("direct", "sidecar"):
                dt = secs[mode]
                row: dict = {"round": r, "mode": mode, "seconds": round(dt, 3), "tok_per_s": round(ntok / dt, 1),
                             "load_avg_1": load}  # fmt: skip
                if mode == "sidecar":
                    row.update({
                        "sidecar_cpu_ms_per_sample": round(1000 * cpu_side / args.n_prompts, 3),
                        "stream_cpu_ms_per_sample": round(1000 * cpu_stream / args.n_prompts, 3),
                        "sidecar_rss_mib": round(side.memory_info().rss / 2**20, 1), "sidecar_fds": side.num_fds(),
                        "sidecar_threads": side.num_threads(),
                        "ledger_bytes": sum(f.stat().st_size for f in ledger.parent.glob(ledger.name + "*")),
                    })  # fmt: skip
                rows.append(row)
                extra = (f"  sidecar {row['sidecar_cpu_ms_per_sample']} ms CPU/sample, stream "
                         f"{row['stream_cpu_ms_per_sample']}, RSS {row['sidecar_rss_mib']} MiB, fds {row['sidecar_fds']}, "
                         f"ledger {row['ledger_bytes'] / 2**20:.1f} MiB") if mode == "sidecar" else ""  # fmt: skip
                print(f"round {r} {mode:8s} {ntok / dt:10,.0f} tok/s  load {load}{extra}", flush=True)
        left = stack.spool_files()
    finally:
        stack.stop()
        stack.remove_spool()
    def per_round(mode: str) -> list[float]:
        return [next(x["tok_per_s"] for x in rows if x["round"] == r and x["mode"] == mode) for r in range(args.rounds)]

    d = statistics.mean(x["tok_per_s"] for x in rows if x["mode"] == "direct")
    s = statistics.mean(x["tok_per_s"] for x in rows if x["mode"] == "sidecar")
    ratios = [next(x for x in rows if x["round"] == r and x["mode"] == "sidecar")["tok_per_s"]
              / next(x for x in rows if x["round"] == r and x["mode"] == "direct")["tok_per_s"]
              for r in range(args.rounds)]  # fmt: skip
    side_rows = [next(x for x in rows if x["round"] == r and x["mode"] == "sidecar") for r in range(args.rounds)]
    trend = {k: slope_rel([x[k] for x in side_rows]) for k in
             ("tok_per_s", "sidecar_cpu_ms_per_sample", "stream_cpu_ms_per_sample", "sidecar_rss_mib", "sidecar_fds",
              "ledger_bytes")}  # fmt: skip
    trend["ratio_sidecar_to_direct"] = slope_rel(ratios)
    print("\nper round: sidecar ÷ direct", " ".join(f"{x:.3f}" for x in ratios))
    print("trend over the rounds (slope per round ÷ first round):", trend)
    print(f"sidecar last/first {per_round('sidecar')[-1] / per_round('sidecar')[0]:.3f}, "
          f"direct last/first {per_round('direct')[-1] / per_round('direct')[0]:.3f}, "
          f"(sidecar ÷ direct) last/first {ratios[-1] / ratios[0]:.3f}")
    print("\n| path | tok/s (mean) | ÷ direct |\n|---|---|---|")
    print(f"| direct to vLLM | {d:,.0f} | 1.000 |\n| through sidecar + HiddenStateStream | {s:,.0f} | "
          f"{statistics.mean(ratios):.3f} |")  # fmt: skip
    doc = {"benchmark": "sidecar_overhead", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "command": "python bench/costs/sidecar_overhead.py " + " ".join(sys.argv[1:]), "args": vars(args),
           "cpu_threads_bind": launch.cpu_env().get("VLLM_CPU_OMP_THREADS_BIND"), "device": "cpu (2 cores)",
           "direct_tok_per_s": round(d, 1), "sidecar_tok_per_s": round(s, 1),
           "ratio_sidecar_to_direct_per_round": [round(x, 4) for x in ratios],
           "ratio_sidecar_to_direct": round(statistics.mean(ratios), 4),
           # Decay as jobs accumulate: the last round's rate over the first's, per path.
           "sidecar_last_over_first": round(per_round("sidecar")[-1] / per_round("sidecar")[0], 4),
           "direct_last_over_first": round(per_round("direct")[-1] / per_round("direct")[0], 4),
           # The same, each round's sidecar rate taken relative to the direct round beside it (the
           # machine's load moves both): last round's ratio over the first's.
           "ratio_last_over_first": round(ratios[-1] / ratios[0], 4),
           # Growth independent of the machine's noise: slope per round relative to the first round.
           "sidecar_trend_per_round": trend,
           "ratio_sidecar_to_direct_median": round(statistics.median(ratios), 4),
           "sidecar_profiles_first_last_round": profiles,
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "runs": rows,
           "spool_files_left": len(left), "spool_files_left_first": left[:5]}  # fmt: skip
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=1))
    print("wrote", out)
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
