#!/usr/bin/env python3
"""The real model's served acceptance on a GPU, for each draft this vLLM serves (issue 44, 2).

For one ``--draft`` (one device call each, docs/gpu-plan.md):

1. train it online: ``hsstream up --train "…"`` — vLLM (CUDA) with our connector, the sidecar and
   ``hsstream train`` on the same GPU — on the first ``--train-samples`` conversations of a
   ShareGPT file (``--submit-preset sharegpt``), ``--steps`` steps; the run's ``result.json``
   gives the trainer's samples/s and the share of its time it waited for data;
2. an untrained draft of the same architecture and vocabulary maps (the run's ``vocab_maps.pt``);
3. serve the verifier with each (``hsstream eval``: T=0 and T=1, the no-draft baseline once),
   on held-out prompts: the first human turn of the conversations after the trained ones;
4. write ``bench/results/NAME.json`` (and ``$OUT/NAME.json``): per draft and temperature the mean
   acceptance length (tokens per verifier step) and tokens/s, trained and untrained, the
   baseline's tokens/s, the trainer's figures, the commands.

Acceptance target (the issue): trained mean acceptance length at T=0 ≥ untrained + 0.5.

    python bench/gpu_plan/real_model.py --probe                       # the drafts this vLLM serves
    python bench/gpu_plan/real_model.py --make-data SHAREGPT OUT.jsonl 3200  # a subset to carry
    python bench/gpu_plan/real_model.py --model DIR --data FILE --draft eagle3 --dry-run   # checks, commands
    python bench/gpu_plan/real_model.py --model DIR --data FILE --draft eagle3 --name real_model_h200_eagle3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: The margin the issue asks of a trained draft over an untrained one (mean acceptance length, T=0).
MAL_MARGIN = 0.5


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def served_drafts() -> dict[str, bool]:
    """Which of our drafts this vLLM can be asked to serve: its ``SpeculativeMethod`` names the
    draft's method (and, for P-EAGLE, ``SpeculativeConfig`` has ``parallel_drafting``). A GPU-only
    draft (DSpark: Model Runner V2) is listed as served; it is refused on the CPU build later."""
    import typing

    import vllm.config.speculative as S

    from hsstream.evaluate import SERVED

    methods = set(typing.get_args(getattr(S, "SpeculativeMethod", typing.Literal[()])))
    cfg = S.SpeculativeConfig
    fields = set(getattr(cfg, "__dataclass_fields__", {}) or getattr(cfg, "model_fields", {}))
    return {d: spec["method"] in methods and all(k in fields for k in spec if k != "method")
            for d, spec in SERVED.items()}  # fmt: skip


def layer_ids(model: Path) -> list[int]:
    """Eagle-3's default aux layers (2, N//2, N-3) and N, for the verifier in ``model``."""
    n = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
    return [2, n // 2, n - 3, n]


def held_out(data: Path, skip: int, n: int) -> list[dict]:
    """The first human turn of ``n`` conversations after the first ``skip`` (those are trained
    on), as ``hsstream eval --prompts`` takes them."""
    from trainer_client.data_sources import iter_samples

    out = []
    for i, s in enumerate(iter_samples(str(data), preset="sharegpt")):
        if i < skip:
            continue
        msgs = s.get("messages") or s.get("conversations") or []  # OpenAI roles, or ShareGPT's from/value
        first = next((m.get("content") or m.get("value") for m in msgs
                      if (m.get("role") or m.get("from")) in ("user", "human") and (m.get("content") or m.get("value"))), None)
        if first:
            out.append({"prompt": first[:2000]})
        if len(out) >= n:
            break
    return out


def make_data(src: Path, out: Path, rows: int) -> int:
    """The first ``rows`` conversations of ``src`` (the ShareGPT file ``hsstream data get`` fetches:
    a truncated JSON array, read row by row) as JSONL small enough to carry; returns the count."""
    import itertools

    from trainer_client.data_sources import iter_rows

    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out, "w") as f:
        for row in itertools.islice(iter_rows(str(src)), rows):
            f.write(json.dumps(row) + "\n")
            n += 1
    return n


def commands(a: argparse.Namespace, wd: Path) -> dict[str, list[str]]:
    m, run = str(a.model), wd / a.draft / "run"
    train = (f"--out {run} --submit {a.data} --submit-preset sharegpt --submit-limit {a.train_samples} "
             f"--draft {a.draft} --steps {a.steps} --lr {a.lr} --checkpoint-every {a.steps} --no-progress "
             f"--logger none" + (f" --mask-token-id {a.mask_token_id}" if a.mask_token_id is not None else ""))  # fmt: skip
    up = [sys.executable, "-m", "hsstream", "up", "--model", m, "--layer-ids", ",".join(map(str, layer_ids(a.model))),
          "--max-model-len", str(a.max_model_len), "--gpu-memory-utilization", str(a.gpu_mem_util),
          "--log-dir", str(wd / a.draft / "logs"), "--train", train]  # fmt: skip
    ev = [sys.executable, "-m", "hsstream", "eval", "--model", m, "--prompts", str(wd / "prompts.jsonl"),
          "--temperature", "0", "--temperature", "1", "--max-tokens", str(a.max_tokens),
          "--max-model-len", str(a.max_model_len), "--json"]  # fmt: skip
    return {"up": up, "eval_trained": [*ev, "--draft", str(run / "final"), "--workdir", str(wd / a.draft / "eval")],
            "eval_untrained": [*ev, "--draft", str(wd / a.draft / "untrained-draft"), "--no-baseline",
                               "--workdir", str(wd / a.draft / "eval-untrained")]}  # fmt: skip


def check(a: argparse.Namespace, cmds: dict[str, list[str]]) -> None:
    """What can be checked without a GPU: the model, the data, the draft, every command's flags."""
    import typer

    from hsstream.cli import app
    from trainer_client import drafts as D

    if not (a.model / "config.json").exists():
        raise SystemExit(f"--model {a.model}: no config.json")
    if a.draft not in D.REGISTRY:
        raise SystemExit(f"--draft {a.draft}: not one of {sorted(D.REGISTRY)}")
    rows = len(held_out(a.data, a.train_samples, a.eval_prompts))
    if rows < a.eval_prompts:
        raise SystemExit(f"--data {a.data}: {rows} held-out prompts after {a.train_samples} trained, {a.eval_prompts} asked")
    group = typer.main.get_command(app)
    up = cmds["up"][3:]
    train = up[up.index("--train") + 1]
    for name, argv in (("up", up), ("train", shlex.split(train)), ("eval", cmds["eval_trained"][4:]),
                       ("eval", cmds["eval_untrained"][4:])):  # fmt: skip
        with group.commands[name].make_context(f"hsstream {name}", list(argv), resilient_parsing=False):
            pass


def untrained_draft(a: argparse.Namespace, run: Path, out: Path) -> None:
    """A draft of the trained one's architecture and vocabulary maps, never trained (seed 1)."""
    import torch

    from trainer_client import drafts as D
    from trainer_client.train.checkpoints import verifier_text_config
    from trainer_client.train.config import TrainConfig

    maps = torch.load(run / "vocab_maps.pt", weights_only=True)
    tc = TrainConfig(verifier=str(a.model), out_dir=str(out.parent / "untrained"), draft=a.draft,
                     **({"mask_token_id": a.mask_token_id} if a.mask_token_id is not None else {}))  # fmt: skip
    plug = D.get(a.draft)(tc, verifier_text_config(str(a.model)))
    d = plug.build(layer_ids(a.model)[:3], draft_vocab_size=maps["draft_vocab_size"], t2d=maps["t2d"], d2t=maps["d2t"],
                   seed=1)  # fmt: skip
    d.save_pretrained(out)


def per_temperature(ev: dict) -> dict:
    """``hsstream eval --json``'s figures by temperature: ours (from the requests' records) and
    vLLM's counters' mean acceptance length, per position, tokens/s with and without the draft."""
    return {t: {"mean_acceptance_length": v["ours"].get("mean_acceptance_length"),
                "vllm_mean_acceptance_length": v["vllm_metrics"].get("mean_acceptance_length"),
                "acceptance_per_position": v["ours"].get("acceptance_per_position"),
                "tokens_per_s": v["tokens_per_s"]["with_draft"], "baseline_tokens_per_s": v["tokens_per_s"]["without_draft"]}
            for t, v in ev["temperatures"].items()}  # fmt: skip


def run(a: argparse.Namespace, wd: Path, cmds: dict[str, list[str]]) -> dict:
    res: dict = {"benchmark": "real_model_gpu", "draft": a.draft, "model": str(a.model), "data": str(a.data),
                 "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "commands": {k: shlex.join(v) for k, v in cmds.items()},
                 "args": {k: str(v) for k, v in vars(a).items()}}  # fmt: skip
    (wd / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in held_out(a.data, a.train_samples,
                                                                                      a.eval_prompts)))
    t0 = time.perf_counter()
    p = subprocess.run(cmds["up"], cwd=ROOT, capture_output=True, text=True, timeout=a.train_timeout)
    res["up_s"] = round(time.perf_counter() - t0, 1)
    (wd / a.draft / "up.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        res["error"] = f"hsstream up exited {p.returncode}: {(p.stderr or p.stdout)[-3000:]}"
        return res
    run_dir = wd / a.draft / "run"
    tr = json.loads((run_dir / "result.json").read_text())
    res["trainer"] = {k: tr.get(k) for k in ("samples", "tokens", "steps", "wall_s", "wait_s", "world_size", "device",
                                             "top1", "loss")}  # fmt: skip
    if tr.get("wall_s"):
        res["trainer"]["samples_per_s"] = round(tr["samples"] / tr["wall_s"], 2)
        res["trainer"]["wait_frac"] = round(tr["wait_s"] / tr["wall_s"], 4)
    untrained_draft(a, run_dir, wd / a.draft / "untrained-draft")
    for arm in ("trained", "untrained"):
        p = subprocess.run(cmds[f"eval_{arm}"], cwd=ROOT, capture_output=True, text=True, timeout=a.eval_timeout)
        if p.returncode != 0:
            res["error"] = f"hsstream eval ({arm}) exited {p.returncode}: {p.stderr[-3000:]}"
            return res
        res[arm] = per_temperature(json.loads(p.stdout))
    t0_tr, t0_un = res["trained"]["0.0"]["mean_acceptance_length"], res["untrained"]["0.0"]["mean_acceptance_length"]
    res["checks"] = {f"t0_mal_trained_ge_untrained_plus_{MAL_MARGIN}": t0_tr is not None and t0_un is not None
                     and t0_tr >= t0_un + MAL_MARGIN}  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", action="store_true", help="print which drafts this vLLM serves, as JSON, and exit")
    ap.add_argument("--make-data", nargs=3, metavar=("SRC", "OUT", "ROWS"),
                    help="write the first ROWS conversations of SRC to OUT (JSONL) and exit")
    ap.add_argument("--model", type=Path, help="the verifier (SmolLM2-135M-Instruct: `hsstream models get smollm2`)")
    ap.add_argument("--data", type=Path, help="ShareGPT conversations (JSON array or JSONL, `sharegpt` preset)")
    ap.add_argument("--draft", default="eagle3")
    ap.add_argument("--mask-token-id", type=int, default=None, help="peagle/dflash/dspark: the mask token (hsstream train's)")
    ap.add_argument("--train-samples", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-mem-util", type=float, default=0.4, help="vLLM's share: the trainer uses the same GPU")
    ap.add_argument("--train-timeout", type=float, default=420)
    ap.add_argument("--eval-timeout", type=float, default=240)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--name", default=None, help="bench/results/NAME.json (default real_model_gpu_<draft>)")
    ap.add_argument("--dry-run", action="store_true", help="check the model, data and every command's flags; print them")
    a = ap.parse_args(argv)
    if a.probe:
        print(json.dumps(served_drafts()))
        return 0
    if a.make_data:
        print(f"{make_data(Path(a.make_data[0]), Path(a.make_data[1]), int(a.make_data[2]))} rows in {a.make_data[1]}")
        return 0
    if a.model is None or a.data is None:
        ap.error("--model and --data are needed (or --probe)")
    a.model, a.data = a.model.resolve(), a.data.resolve()
    wd = (a.workdir or Path(tempfile.mkdtemp(prefix="hsstream-real-model-"))).resolve()
    (wd / a.draft).mkdir(parents=True, exist_ok=True)
    cmds = commands(a, wd)
    check(a, cmds)
    if a.dry_run:
        for k, v in cmds.items():
            print(f"{k}: {shlex.join(v)}")
        return 0
    res = run(a, wd, cmds)
    name = a.name or f"real_model_gpu_{a.draft}"
    for d in [ROOT / "bench" / "results"] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    log(json.dumps({k: res.get(k) for k in ("trainer", "trained", "untrained", "checks", "error")}))
    return 0 if not res.get("error") and all(res.get("checks", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
