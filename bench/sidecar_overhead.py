#!/usr/bin/env python3
"""Tokens/s through the sidecar vs the same prompts sent straight to vLLM, interleaved.

Both paths use the same running vLLM (CPU build here, with our connector) and the same
concurrency. "direct" is what a hand-rolled client does: POST each prompt to /v1/completions,
wait for its file, delete it. "sidecar" is the product: one REST job, a HiddenStateStream
consuming and validating every sample. Rounds alternate so both see the same machine noise.

    python bench/sidecar_overhead.py            # tiny model, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in ps))
        return time.perf_counter() - t0


def via_sidecar(stack, ps: list[list[int]]) -> float:
    from trainer_client import HiddenStateStream

    t0 = time.perf_counter()
    r = httpx.post(f"{stack.api}/v1/jobs", json={"samples": [{"token_ids": p} for p in ps]}, timeout=60)
    r.raise_for_status()
    with HiddenStateStream(stack.delivery_endpoint, jobs=[r.json()["job_id"]], spool_dir=stack.spool,
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
    args = ap.parse_args()
    from hsstream import launch
    from hsstream.demo import Stack
    from hsstream.tiny_model import build_tiny_verifier

    model = str(build_tiny_verifier())
    stack = Stack(model, [2, 6, 9, 12], Path(tempfile.mkdtemp(prefix="hsstream-bench-")))
    stack.env["HSSTREAM_MAX_CONCURRENCY"] = str(args.concurrency)
    rows = []
    try:
        stack.start()
        vllm = f"http://127.0.0.1:{stack.vllm_port}"
        ntok = args.n_prompts * args.prompt_len
        asyncio.run(direct(vllm, prompts(8, args.prompt_len, 99), args.concurrency))  # warm up both paths
        via_sidecar(stack, prompts(8, args.prompt_len, 98))
        for r in range(args.rounds):
            ps = prompts(args.n_prompts, args.prompt_len, r)
            for mode in (("direct", "sidecar") if r % 2 == 0 else ("sidecar", "direct")):
                dt = asyncio.run(direct(vllm, ps, args.concurrency)) if mode == "direct" else via_sidecar(stack, ps)
                rows.append({"round": r, "mode": mode, "seconds": round(dt, 3), "tok_per_s": round(ntok / dt, 1)})
                print(f"round {r} {mode:8s} {ntok / dt:10,.0f} tok/s", flush=True)
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
    print("\n| path | tok/s (mean) | ÷ direct |\n|---|---|---|")
    print(f"| direct to vLLM | {d:,.0f} | 1.000 |\n| through sidecar + HiddenStateStream | {s:,.0f} | "
          f"{statistics.mean(ratios):.3f} |")  # fmt: skip
    doc = {"benchmark": "sidecar_overhead", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "command": "python bench/sidecar_overhead.py " + " ".join(sys.argv[1:]), "args": vars(args),
           "cpu_threads_bind": launch.cpu_env().get("VLLM_CPU_OMP_THREADS_BIND"), "device": "cpu (2 cores)",
           "direct_tok_per_s": round(d, 1), "sidecar_tok_per_s": round(s, 1),
           "ratio_sidecar_to_direct_per_round": [round(x, 4) for x in ratios],
           "ratio_sidecar_to_direct": round(statistics.mean(ratios), 4),
           # Decay as jobs accumulate: the last round's rate over the first's, per path.
           "sidecar_last_over_first": round(per_round("sidecar")[-1] / per_round("sidecar")[0], 4),
           "direct_last_over_first": round(per_round("direct")[-1] / per_round("direct")[0], 4),
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "runs": rows,
           "spool_files_left": len(left)}  # fmt: skip
    out = ROOT / "bench" / "results" / "sidecar_overhead_cpu.json"
    out.write_text(json.dumps(doc, indent=1))
    print("wrote", out)
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
