#!/usr/bin/env python3
"""The whole loop, measured: hidden states streamed from vLLM train a draft that vLLM serves.

1. The tiny verifier, briefly pre-trained on a structured corpus (hsstream/pretrain_verifier.py,
   cached) so that it does not fall into single-token loops; its greedy repeat fraction is
   measured and must be < 0.3.
2. The real stack (vLLM CPU build with our connector + sidecar) streams its hidden states for
   training documents (drawn with another seed than the verifier's and the evaluation's;
   ``--data regenerate`` instead has the verifier write replies to training prompts, the
   sidecar's regenerate mode); ``hsstream train`` trains a draft online for a bounded number
   of steps.
3. vLLM serves the verifier with the trained draft and with an untrained one (same
   architecture and vocabulary maps), ``num_speculative_tokens=3``, on held-out prompts, at
   temperature 0 and 1; acceptance rate = accepted / drafted tokens from vLLM's own
   spec-decode counters (the serving code is hsstream/evaluate.py's, which
   ``hsstream eval`` runs). Every vLLM process here has the CPU sampling fix applied
   (hsstream/vllm_cpu_fix.py, a vLLM plugin; docs/vllm-cpu-fix.md); ``--show-bug`` also runs
   the trained draft at temperature 1 without it.

Writes bench/results/acceptance_cpu.json (and $OUT/ if set) and exits non-zero if a target
(trained ≥ 0.7 at T=0 and ≥ 0.3 at T=1, each ≥ 0.15 above untrained) is missed.

``--draft peagle|dflash`` trains that draft instead (the same stack, layers and data) and writes
bench/results/acceptance_<draft>_cpu.json: per temperature acceptance per position, the mean
acceptance length (tokens per verifier step) and tokens/s with and without the draft, trained
and untrained, and the trainer's speed; its targets: trained mean acceptance length at T=0
≥ 1.5 and ≥ 0.4 above the untrained draft's. The mask token is the verifier's ``<|im_start|>``
(no training document holds it) unless ``--mask-token-id`` says otherwise: the tiny verifier
declares no mask token, has no spare embedding row, and its pad token's row is zero (docs/trainer.md,
"Drafts").

    python bench/served_acceptance/acceptance.py                                  # ~10 min on 2 busy cores
    python bench/served_acceptance/acceptance.py --draft dflash --steps 800       # DFlash (block of 4: 3 drafted tokens)
    python bench/served_acceptance/acceptance.py --train-samples 400 --steps 400  # shorter training
    python bench/served_acceptance/acceptance.py --payload-dtype fp8_e4m3 --seed 1 --no-untrained  # one arm of fp8_acceptance.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hsstream.evaluate import SPEC_TOKENS, run_serving  # noqa: E402  (bench/online_vs_offline/online_vs_offline.py imports run_serving from here)

TARGETS = {"t0_min": 0.7, "t1_min": 0.3, "margin_min": 0.15}
#: the parallel drafts' targets: mean acceptance length (tokens per verifier step) at T=0
MAL_TARGETS = {"t0_mal_min": 1.5, "t0_mal_margin_min": 0.4}
LAYERS = [2, 6, 9, 12]
RUN_DIR_NAME = "draft-run"  # under --workdir: replaced by each run (train_draft)


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def write_result(result: dict, out: str | Path) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")


def verdict(checks: dict[str, bool]) -> int:
    """The exit status (0 only if every check passed), after naming each missed check, so a
    failed run says why in its last lines."""
    for k, ok in checks.items():
        if not ok:
            print(f"MISSED: {k}")
    return 0 if all(checks.values()) else 1


# --------------------------------------------------------------------------------------------
# Serving: hsstream/evaluate.py (one engine per child process; `hsstream eval` serves through it too)
# --------------------------------------------------------------------------------------------


def submit(stack, samples: list[dict], options: dict) -> str:  # noqa: ANN001 - a devstack Stack
    with stack.client(timeout=120) as c:
        return c.create_job(samples, options).job_id


def train_draft(verifier: str, stack, jobs: list[str], workdir: Path, *, draft_vocab_size: int, steps: int | None,  # noqa: ANN001
                lr: float, seed: int, checkpoint_every: int = 200,
                extra: list[str] | None = None) -> tuple[list[str], subprocess.CompletedProcess, float]:  # fmt: skip
    """``hsstream train`` on ``jobs`` from ``stack``'s stream into WORKDIR/draft-run: the command,
    its finished process (stdout: the run's JSON summary; stderr also in WORKDIR/train.log) and
    its wall time.

    The run directory is this invocation's own and is emptied first: one left by an earlier run
    in the same workdir (``make demo`` again) follows jobs of a sidecar that is gone (its ledger
    went with that run's stack), so ``hsstream train`` would refuse it ("belongs to a run
    following jobs ...") and it could never be resumed. The verifier is cached elsewhere
    (hsstream/pretrain_verifier.py), so later runs stay fast.
    """
    run_dir = workdir / RUN_DIR_NAME
    if run_dir.exists():
        log(f"removing the previous run's {run_dir}")
        shutil.rmtree(run_dir)
    cmd = [
        sys.executable, "-m", "hsstream", "train", "--model", verifier, "--out", str(run_dir),
        *[x for j in jobs for x in ("--job", j)], "--api", stack.api,
        "--endpoint", stack.delivery_endpoint, "--spool", str(stack.spool),
        "--draft-vocab-size", str(draft_vocab_size), *(["--steps", str(steps)] if steps is not None else []), "--lr", str(lr),
        "--checkpoint-every", str(checkpoint_every), "--no-progress", "--seed", str(seed), *(extra or []),
    ]  # fmt: skip
    log("training: " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=3600, env=stack.client_env())
    wall = time.perf_counter() - t0
    (workdir / "train.log").write_text(p.stderr)
    return cmd, p, wall


# --------------------------------------------------------------------------------------------
# The measurement
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=("corpus", "regenerate"), default="corpus",
                    help="corpus: training documents as they are; regenerate: the verifier writes replies to "
                         "training prompts (half T=0, half T=1), only the replies carry loss")  # fmt: skip
    ap.add_argument("--train-samples", type=int, default=1600, help="training samples streamed")
    ap.add_argument("--steps", type=int, default=1600, help="training steps (one sample each)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--draft-vocab-size", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--show-bug", action="store_true", help="also serve at T=1 without the CPU fix")
    ap.add_argument("--payload-dtype", default="model", help="HSSTREAM_PAYLOAD_DTYPE of the stack (model, fp8_e4m3)")
    ap.add_argument("--seed", type=int, default=0, help="the trainer's seed (draft init, order)")
    ap.add_argument("--no-untrained", action="store_true",
                    help="skip serving the untrained draft (its margin checks are then not made)")  # fmt: skip
    ap.add_argument("--workdir", default=None,
                    help="logs, drafts and serving results (default: a new temp dir); may be reused: its "
                         f"{RUN_DIR_NAME}/ is replaced by each run")  # fmt: skip
    ap.add_argument("--draft", choices=("eagle3", "peagle", "dflash"), default="eagle3")
    ap.add_argument("--mask-token-id", type=int, default=None, help="peagle/dflash (default: the verifier's <|im_start|>)")
    ap.add_argument("--block-size", type=int, default=4, help="dflash: tokens per block (block_size - 1 drafted)")
    ap.add_argument("--num-depths", type=int, default=3, help="peagle: tokens drafted in parallel")
    ap.add_argument("--out", default=None, help="default bench/results/acceptance_cpu.json (Eagle-3), "
                                                "acceptance_<draft>_cpu.json for the others")  # fmt: skip
    a = ap.parse_args(argv)
    if a.out is None:
        name = "acceptance_cpu.json" if a.draft == "eagle3" else f"acceptance_{a.draft}_cpu.json"
        a.out = str(ROOT / "bench" / "results" / name)
    if a.draft != "eagle3":
        return parallel_draft(a, argv)

    import torch

    from hsstream import pretrain_verifier as PV
    from hsstream.devstack import Stack
    from trainer_client.drafts import eagle3 as E3
    from trainer_client.train import vocab as V

    t_all = time.perf_counter()
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="hsstream-acceptance-"))
    wd.mkdir(parents=True, exist_ok=True)
    log(f"workdir {wd}")

    t0 = time.perf_counter()
    verifier = str(PV.pretrained_verifier())
    report = json.loads((Path(verifier) / PV.REPORT_NAME).read_text())
    repeat = PV.greedy_repeat_fraction(verifier)
    log(f"verifier {verifier}: greedy repeat fraction {repeat:.3f} (pre-training report {report['greedy_repeat_fraction']:.3f})")
    if repeat >= 0.3:
        log("the verifier still loops: acceptance on it would mean nothing")
        return 1
    t_verifier = time.perf_counter() - t0

    # -- 2. stream + train -------------------------------------------------------------------
    run_dir = wd / RUN_DIR_NAME
    stack = Stack(verifier, LAYERS, wd)
    stack.env["HSSTREAM_PAYLOAD_DTYPE"] = a.payload_dtype
    t0 = time.perf_counter()
    try:
        stack.start()
        t_stack = time.perf_counter() - t0
        log(f"stack up in {t_stack:.0f} s (vLLM CPU build + sidecar), spool {stack.spool}")
        jobs, job_specs = [], []
        if a.data == "regenerate":
            # The verifier writes the replies (as a served draft will face them): half greedy, half sampled.
            prompts_train = PV.held_out_prompts(a.train_samples, seed=PV.SEED_DRAFT_TRAIN, max_chars=200)
            half = len(prompts_train) // 2
            for temp, part in ((0.0, prompts_train[:half]), (1.0, prompts_train[half:])):
                opts = {"mode": "regenerate", "loss_mask": "all",
                        "sampling": {"max_tokens": a.max_tokens, "temperature": temp, "seed": 7}}  # fmt: skip
                job_specs.append({"samples": len(part), "options": opts})
                jobs.append(submit(stack, [{"prompt": p} for p in part], opts))
        else:
            docs = PV.corpus_documents(a.train_samples, PV.SEED_DRAFT_TRAIN)
            opts = {"loss_mask": "all"}
            job_specs.append({"samples": len(docs), "options": opts})
            jobs.append(submit(stack, [{"prompt": d} for d in docs], opts))
        cmd, p, t_train = train_draft(verifier, stack, jobs, wd, draft_vocab_size=a.draft_vocab_size, steps=a.steps,
                                      lr=a.lr, seed=a.seed)  # fmt: skip
        if p.returncode != 0:
            log(f"training failed ({p.returncode}):\n" + "\n".join(p.stderr.splitlines()[-30:]))
            return 1
        train = json.loads(p.stdout[p.stdout.index("{") :])
        with stack.client(timeout=30) as c:
            consumed = [c.job(j) for j in jobs]
        payload = {"payload_dtype": a.payload_dtype, "tokens_consumed": sum(c.tokens_consumed for c in consumed),
                   "bytes_consumed": sum(c.bytes_consumed for c in consumed)}  # fmt: skip
        payload["bytes_per_token"] = round(payload["bytes_consumed"] / max(1, payload["tokens_consumed"]), 2)
        log(f"payload {a.payload_dtype}: {payload['bytes_per_token']} bytes per token (hidden states + scales)")
        log(f"trained {train['steps']} steps on {train['samples']} samples ({train['tokens']} tokens) in {t_train:.0f} s; "
            f"top-1 per TTT step {[round(x, 3) for x in train['top1']]}, waiting for data {train['wait_s']:.0f} s")  # fmt: skip
    finally:
        stack.stop()
        stack.remove_spool()
    draft = train["draft_dir"]

    # -- untrained draft: same architecture, same maps ----------------------------------------
    maps = torch.load(run_dir / "vocab_maps.pt", weights_only=True)
    untrained = E3.build_draft(
        verifier, LAYERS[:3], draft_vocab_size=maps["draft_vocab_size"], t2d=maps["t2d"], d2t=maps["d2t"], seed=1
    )
    untrained_dir = wd / "untrained-draft"
    untrained.save_pretrained(untrained_dir)
    counts = V.token_counts_from_file(run_dir / "token_counts.json")
    cov = V.coverage(counts, maps["t2d"])

    # -- 3. serve ------------------------------------------------------------------------------
    prompts = PV.held_out_prompts(a.eval_prompts)
    serving = {}
    arms = (("trained", draft),) if a.no_untrained else (("trained", draft), ("untrained", str(untrained_dir)))
    for name, d in arms:
        log(f"serving the verifier with the {name} draft (T=0 and T=1, {len(prompts)} prompts x {a.max_tokens} tokens)")
        serving[name] = run_serving(verifier, d, prompts, a.max_tokens, [0.0, 1.0], wd, name)
        log(f"  {name}: " + ", ".join(f"T={t}: {v['acceptance_rate'] or 0:.3f} ({v['accepted']:.0f}/{v['drafted']:.0f})"
                                      for t, v in serving[name].items() if isinstance(v, dict)))  # fmt: skip
    if a.show_bug:
        log("serving the trained draft at T=1 WITHOUT the CPU fix (to show the bug)")
        serving["trained_without_cpu_fix"] = run_serving(verifier, draft, prompts, a.max_tokens, [1.0], wd, "nofix",
                                                         fix=False)  # fmt: skip

    def rate(name: str, t: str) -> float:
        return (serving[name][t]["acceptance_rate"] or 0.0) if name in serving else float("nan")

    tr0, tr1, un0, un1 = rate("trained", "0.0"), rate("trained", "1.0"), rate("untrained", "0.0"), rate("untrained", "1.0")
    checks = {
        "trained_t0_ge_0.7": tr0 >= TARGETS["t0_min"],
        "trained_t1_ge_0.3": tr1 >= TARGETS["t1_min"],
        **({} if a.no_untrained else {"margin_t0_ge_0.15": tr0 - un0 >= TARGETS["margin_min"],
                                      "margin_t1_ge_0.15": tr1 - un1 >= TARGETS["margin_min"]}),
        "verifier_repeat_lt_0.3": repeat < 0.3,
    }
    result = {
        "benchmark": "eagle3_acceptance_cpu",
        "command": "python bench/served_acceptance/acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "train_command": "hsstream " + " ".join(cmd[3:]),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "verifier": {"path": verifier, "greedy_repeat_fraction": repeat, "pretrain": report},
        "training": {
            **train,
            "train_wall_s": round(t_train, 1),
            "stack_start_s": round(t_stack, 1),
            "draft_vocab_size": maps["draft_vocab_size"],
            "draft_vocab_coverage_of_training_tokens": cov,
            "jobs": job_specs,
        },
        "payload": payload,
        "serving": {"num_speculative_tokens": SPEC_TOKENS, "prompts": len(prompts), "max_tokens": a.max_tokens, **serving},
        "acceptance": {"trained": {"T0": tr0, "T1": tr1},
                       **({} if a.no_untrained else {"untrained": {"T0": un0, "T1": un1}})},
        "targets": TARGETS,
        "checks": checks,
        "passed": all(checks.values()),
        "wall_s": {"total": round(time.perf_counter() - t_all, 1), "verifier": round(t_verifier, 1)},
    }
    write_result(result, a.out)
    if os.environ.get("OUT"):
        shutil.copy(a.out, Path(os.environ["OUT"]) / Path(a.out).name)
    print(f"\n{'draft':<12}{'T=0':>8}{'T=1':>8}")
    print(f"{'trained':<12}{tr0:>8.3f}{tr1:>8.3f}")
    print(f"{'untrained':<12}{un0:>8.3f}{un1:>8.3f}")
    if a.show_bug:
        print(f"{'no CPU fix':<12}{'':>8}{rate('trained_without_cpu_fix', '1.0'):>8.3f}")
    print(f"training: {train['steps']} steps, {train['samples']} samples, {train['tokens']} tokens, {t_train:.0f} s; "
          f"total {result['wall_s']['total']:.0f} s -> {a.out}")  # fmt: skip
    return verdict(checks)


def mask_token_id(verifier: str, given: int | None) -> int:
    if given is not None:
        return given
    from transformers import AutoTokenizer

    return int(AutoTokenizer.from_pretrained(verifier).convert_tokens_to_ids("<|im_start|>"))


def stream_and_train(a, verifier: str, wd: Path, extra: list[str]) -> tuple:  # noqa: ANN001
    """The stack streams the training documents; ``hsstream train`` trains on them."""
    from hsstream import pretrain_verifier as PV
    from hsstream.devstack import Stack

    stack = Stack(verifier, LAYERS, wd)
    t0 = time.perf_counter()
    try:
        stack.start()
        t_stack = time.perf_counter() - t0
        log(f"stack up in {t_stack:.0f} s (vLLM CPU build + sidecar), spool {stack.spool}")
        docs = PV.corpus_documents(a.train_samples, PV.SEED_DRAFT_TRAIN)
        opts = {"loss_mask": "all"}
        jobs = [submit(stack, [{"prompt": d} for d in docs], opts)]
        cmd, p, t_train = train_draft(verifier, stack, jobs, wd, draft_vocab_size=a.draft_vocab_size, steps=a.steps,
                                      lr=a.lr, seed=a.seed, extra=extra)  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"training failed ({p.returncode}):\n" + "\n".join(p.stderr.splitlines()[-30:]))
        train = json.loads(p.stdout[p.stdout.index("{") :])
    finally:
        stack.stop()
        stack.remove_spool()
    return cmd, train, t_train, t_stack, [{"samples": len(docs), "options": opts}]


def train_named_draft(a, prefix: str) -> tuple:  # noqa: ANN001
    """The first half of a named draft's benchmark (this script's P-EAGLE/DFlash arm,
    bench/served_acceptance/trainer_speed.py): its workdir, the pre-trained verifier, its mask token and
    :func:`stream_and_train` with the draft's flags. Returns (workdir, verifier, mask, and
    stream_and_train's tuple)."""
    from hsstream import pretrain_verifier as PV

    wd = Path(a.workdir or tempfile.mkdtemp(prefix=f"{prefix}-{a.draft}-"))
    wd.mkdir(parents=True, exist_ok=True)
    log(f"workdir {wd}")
    verifier = str(PV.pretrained_verifier())
    mask = mask_token_id(verifier, a.mask_token_id)
    extra = ["--draft", a.draft, "--mask-token-id", str(mask), "--block-size", str(a.block_size),
             "--num-depths", str(a.num_depths)]  # fmt: skip
    return wd, verifier, mask, stream_and_train(a, verifier, wd, extra)


def parallel_draft(a, argv) -> int:  # noqa: ANN001, C901
    """P-EAGLE or DFlash through the same loop as Eagle-3; see the module docstring."""
    import torch

    from hsstream import evaluate as E
    from hsstream import pretrain_verifier as PV
    from trainer_client import drafts as D
    from trainer_client.train.checkpoints import verifier_text_config
    from trainer_client.train.config import TrainConfig

    t_all = time.perf_counter()
    wd, verifier, mask, (cmd, train, t_train, t_stack, job_specs) = train_named_draft(a, "hsstream-acceptance")
    draft = train["final_dir"]
    log(f"trained {train['steps']} steps on {train['samples']} samples ({train['tokens']} tokens) in "
        f"{train['wall_s']:.0f} s; in-run top-1 per position {[round(x, 3) for x in train['top1']]}")  # fmt: skip

    # the untrained draft: same architecture, maps and mask token
    maps = torch.load(wd / RUN_DIR_NAME / "vocab_maps.pt", weights_only=True)
    takes = {o.name for o in D.get(a.draft).Options.specs()}  # the settings this draft has
    opts = {"mask_token_id": mask, "block_size": a.block_size, "num_depths": a.num_depths}
    tc = TrainConfig(verifier=verifier, out_dir=str(wd / "untrained"), draft=a.draft,
                     draft_options={k: v for k, v in opts.items() if k in takes})
    plug = D.get(a.draft)(tc, verifier_text_config(verifier))
    untrained = plug.build(LAYERS[:3], draft_vocab_size=maps["draft_vocab_size"], t2d=maps["t2d"], d2t=maps["d2t"],
                           seed=1)  # fmt: skip
    untrained_dir = wd / "untrained-draft"
    untrained.save_pretrained(untrained_dir)

    prompts = PV.held_out_prompts(a.eval_prompts)
    temps = [0.0, 1.0]
    serving: dict = {}
    for name, d in (("trained", draft), ("untrained", str(untrained_dir))):
        spec = E.speculative_config(d)
        log(f"serving the verifier with the {name} draft: {json.dumps({k: v for k, v in spec.items() if k != 'model'})}")
        serving[name] = E.run_serving(verifier, spec["model"], prompts, a.max_tokens, temps, wd, name,
                                      spec_tokens=spec["num_speculative_tokens"], per_request=True, spec=spec)  # fmt: skip
        serving[name]["speculative_config"] = spec
    log("serving the verifier alone (tokens/s without a draft)")
    serving["no_draft"] = E.run_serving(verifier, None, prompts, a.max_tokens, temps, wd, "no-draft", per_request=True)

    def fig(name: str, t: str) -> dict:
        v = serving[name][t]["vllm_metrics"]
        return {"acceptance_rate": v["acceptance_rate"], "mean_acceptance_length": v["mean_acceptance_length"],
                "acceptance_per_position": v["acceptance_per_position"],
                "tokens_per_s": serving[name][t]["tokens_per_s"],
                "ours_mean_acceptance_length": serving[name][t]["ours"]["mean_acceptance_length"]}  # fmt: skip

    acc = {name: {f"T{t[0]}": fig(name, t) for t in ("0.0", "1.0")} for name in ("trained", "untrained")}
    for t in ("0.0", "1.0"):
        acc.setdefault("no_draft", {})[f"T{t[0]}"] = {"tokens_per_s": serving["no_draft"][t]["tokens_per_s"]}
    tr0, un0 = acc["trained"]["T0"]["mean_acceptance_length"], acc["untrained"]["T0"]["mean_acceptance_length"]
    checks = {"trained_t0_mean_acceptance_length_ge_1.5": tr0 >= MAL_TARGETS["t0_mal_min"],
              "margin_t0_mean_acceptance_length_ge_0.4": tr0 - un0 >= MAL_TARGETS["t0_mal_margin_min"]}  # fmt: skip
    wall = float(train["wall_s"]) or float("nan")
    result = {
        "benchmark": f"{a.draft}_acceptance_cpu",
        "draft": a.draft,
        "command": "python bench/served_acceptance/acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "train_command": "hsstream " + " ".join(cmd[3:]),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "verifier": verifier,
        "mask_token_id": mask,
        "training": {**train, "train_wall_s": round(t_train, 1), "stack_start_s": round(t_stack, 1), "jobs": job_specs,
                     "draft_vocab_size": maps["draft_vocab_size"]},  # fmt: skip
        "trainer_speed_cpu": {"samples_per_s": round(train["samples"] / wall, 2),
                              "tokens_per_s": round(train["tokens"] / wall, 1), "wall_s": wall,
                              "wait_s": train["wait_s"], "threads": 1},  # fmt: skip
        "in_run_top1_per_position": train["top1"],
        "serving": {"prompts": len(prompts), "max_tokens": a.max_tokens, **serving},
        "acceptance": acc,
        "targets": MAL_TARGETS,
        "checks": checks,
        "passed": all(checks.values()),
        "wall_s": {"total": round(time.perf_counter() - t_all, 1)},
    }
    write_result(result, a.out)
    if os.environ.get("OUT"):
        shutil.copy(a.out, Path(os.environ["OUT"]) / Path(a.out).name)
    print(f"\n{a.draft:<12}{'MAL T=0':>9}{'MAL T=1':>9}{'tok/s T=0':>11}")
    for name in ("trained", "untrained"):
        print(f"{name:<12}{acc[name]['T0']['mean_acceptance_length']:>9.3f}{acc[name]['T1']['mean_acceptance_length']:>9.3f}"
              f"{acc[name]['T0']['tokens_per_s']:>11.1f}")  # fmt: skip
    print(f"{'no draft':<12}{'':>9}{'':>9}{acc['no_draft']['T0']['tokens_per_s']:>11.1f}")
    print(f"training: {train['steps']} steps, {result['trainer_speed_cpu']} -> {a.out}")
    return verdict(checks)


if __name__ == "__main__":
    raise SystemExit(main())
