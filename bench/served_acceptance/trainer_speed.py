#!/usr/bin/env python3
"""The trainer's speed for a draft vLLM's CPU build cannot serve (DSpark), on the same loop as
bench/served_acceptance/acceptance.py's parallel drafts: the stack (vLLM CPU build with our connector + sidecar)
streams the same training documents of the pre-trained tiny verifier, ``hsstream train --draft
NAME`` trains on them online with the same settings (layers 2, 6, 9 + 12, draft vocabulary 256,
lr 3e-3, one sample a step, one thread, the mask token ``<|im_start|>``), and the speed is that
run's samples and tokens over its training wall time, as acceptance_<draft>_cpu.json's
``trainer_speed_cpu``. Serving is not attempted where this vLLM refuses the draft: the result
records ``hsstream eval``'s refusal instead (the draft's plug-in: ``Draft.refusal``).

Writes bench/results/trainer_speed_<draft>_cpu.json (and $OUT/ if set).

    python bench/served_acceptance/trainer_speed.py --draft dspark --steps 400 --train-samples 400
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.served_acceptance.acceptance import LAYERS, log, train_named_draft, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="dspark", help="a registered draft (trainer_client/drafts/)")
    ap.add_argument("--train-samples", type=int, default=400, help="training samples streamed")
    ap.add_argument("--steps", type=int, default=400, help="training steps (one sample each)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab-size", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=4, help="dflash/dspark: tokens per block")
    ap.add_argument("--num-depths", type=int, default=3, help="peagle: tokens drafted in parallel")
    ap.add_argument("--mask-token-id", type=int, default=None, help="default: the verifier's <|im_start|>")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="default bench/results/trainer_speed_<draft>_cpu.json")
    a = ap.parse_args(argv)
    a.out = a.out or str(ROOT / "bench" / "results" / f"trainer_speed_{a.draft}_cpu.json")

    from hsstream import evaluate as E

    t_all = time.perf_counter()
    wd, verifier, mask, (cmd, train, t_train, t_stack, job_specs) = train_named_draft(a, "hsstream-trainer-speed")
    wall = float(train["wall_s"]) or float("nan")
    log(f"trained {train['steps']} steps on {train['samples']} samples ({train['tokens']} tokens) in {wall:.0f} s")
    try:
        spec = E.speculative_config(train["final_dir"])
        serving = {"servable_here": True, "speculative_config": spec}
    except E.DraftError as e:
        serving = {"servable_here": False, "refusal": str(e)}
    result = {
        "benchmark": f"{a.draft}_trainer_speed_cpu",
        "draft": a.draft,
        "command": "python bench/served_acceptance/trainer_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "train_command": "hsstream " + " ".join(cmd[3:]),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "verifier": verifier,
        "layers": LAYERS,
        "mask_token_id": mask,
        "training": {**train, "train_wall_s": round(t_train, 1), "stack_start_s": round(t_stack, 1), "jobs": job_specs},
        "trainer_speed_cpu": {"samples_per_s": round(train["samples"] / wall, 2),
                              "tokens_per_s": round(train["tokens"] / wall, 1), "wall_s": wall,
                              "wait_s": train["wait_s"], "threads": 1},  # fmt: skip
        "in_run_top1_per_position": train["top1"],
        "serving": serving,
        "wall_s": {"total": round(time.perf_counter() - t_all, 1)},
    }
    write_result(result, a.out)
    if os.environ.get("OUT"):
        shutil.copy(a.out, Path(os.environ["OUT"]) / Path(a.out).name)
    print(f"{a.draft}: {result['trainer_speed_cpu']}; in-run top-1 per position "
          f"{[round(x, 3) for x in train['top1']]} -> {a.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
