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
    # a checkpoint every --checkpoint-every-s as well: a run cut at the deadline is evaluated on its newest one
    train = (f"--out {run} --submit {a.data} --submit-preset sharegpt --submit-limit {a.train_samples} "
             f"--draft {a.draft} --steps {a.steps} --lr {a.lr} --checkpoint-every {a.steps} "
             f"--checkpoint-every-s {a.checkpoint_every_s} --no-progress --logger none "
             f"--overlong truncate --max-tokens-per-sample {a.max_model_len - 8}"
             + (f" --mask-token-id {a.mask_token_id}" if a.mask_token_id is not None else "")
             + (f" --init-draft {a.init_draft}" if a.init_draft is not None else ""))  # fmt: skip
    up = [sys.executable, "-m", "hsstream", "up", "--model", m, "--layer-ids", ",".join(map(str, layer_ids(a.model))),
          "--max-model-len", str(a.max_model_len), "--gpu-memory-utilization", str(a.gpu_mem_util),
          "--enforce-eager" if a.enforce_eager else "--no-enforce-eager",
          "--log-dir", str(wd / a.draft / "logs"), "--train", train]  # fmt: skip
    # held out: the rows after the trained ones (--submit-limit counts rows), each prompting with its
    # conversation up to the first reply through the chat template, as the trainer saw it
    ev = [sys.executable, "-m", "hsstream", "eval", "--model", m, "--prompts", str(a.data), "--preset", "sharegpt",
          "--rows", f"{a.train_samples}:", "--max-prompts", str(a.eval_prompts),
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
    vLLM's counters' mean acceptance length, per position, tokens/s with and without the draft.
    ``mean_acceptance_length`` is ours where this vLLM keeps per-request records (after 0.26),
    else its counters' (``mal_from`` says which)."""
    out = {}
    for t, v in ev["temperatures"].items():
        ours, vm = v.get("ours") or {}, v.get("vllm_metrics") or {}
        mal = ours.get("mean_acceptance_length")
        out[t] = {"mean_acceptance_length": mal if mal is not None else vm.get("mean_acceptance_length"),
                  "mal_from": "requests" if mal is not None else "vllm_counters",
                  "vllm_mean_acceptance_length": vm.get("mean_acceptance_length"),
                  "acceptance_per_position": ours.get("acceptance_per_position") or vm.get("acceptance_per_position"),
                  "tokens_per_s": v["tokens_per_s"]["with_draft"],
                  "baseline_tokens_per_s": v["tokens_per_s"]["without_draft"]}  # fmt: skip
    return out


class Clock:
    """The run's deadline (``--deadline-s`` from the script's start; None: none): every phase gets
    at most what is left, so a device call of a fixed length ends with a (partial) JSON."""

    def __init__(self, deadline_s: float | None) -> None:
        self.t0, self.deadline_s = time.monotonic(), deadline_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self, cap: float) -> float:
        return cap if self.deadline_s is None else max(0.0, min(cap, self.deadline_s - self.elapsed()))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): ``hsstream up`` starts each child in its own
    session, so its process group alone does not hold them."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def stop_up(p: subprocess.Popen, grace_s: float) -> bool:
    """SIGTERM to ``hsstream up`` (it stops the trainer, the sidecar and vLLM in order); SIGKILL
    to it and everything below it if it has not ended within ``grace_s``. True: it stopped in time."""
    import signal

    below = descendants(p.pid)
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=grace_s)
        return True
    except subprocess.TimeoutExpired:
        pass
    for pid in [p.pid, *below, *descendants(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    p.wait()
    return False


def trained_draft(run_dir: Path) -> tuple[Path | None, int | None]:
    """The draft to serve: ``final/`` (the run ended), else the newest complete checkpoint's
    ``draft/`` (the run was cut at the deadline); with its step where known."""
    from trainer_client.train.checkpoints import list_checkpoints

    ck = list_checkpoints(run_dir)
    if (run_dir / "final" / "config.json").is_file():
        return run_dir / "final", None
    return (ck[-1][1] / "draft", ck[-1][0]) if ck else (None, None)


def trainer_figures(run_dir: Path) -> dict | None:
    """The trainer's samples/s and waiting share: from ``result.json`` (the run ended), else the
    last line of ``metrics.jsonl`` (cumulative figures up to that step)."""
    rj = run_dir / "result.json"
    if rj.is_file():
        tr = json.loads(rj.read_text())
        out = {k: tr.get(k) for k in ("samples", "tokens", "steps", "wall_s", "wait_s", "world_size", "device", "top1",
                                       "loss")}  # fmt: skip
        if tr.get("wall_s"):
            out["samples_per_s"] = round(tr["samples"] / tr["wall_s"], 2)
            out["wait_frac"] = round(tr["wait_s"] / tr["wall_s"], 4)
        out["from"] = "result.json"
        return out
    lines = [ln for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()] if (
        run_dir / "metrics.jsonl").is_file() else []  # fmt: skip
    if not lines:
        return None
    m = json.loads(lines[-1])
    return {"steps": m.get("step"), "samples_per_s": m.get("samples_per_s"), "wait_frac": m.get("wait_frac"),
            "loss": m.get("loss"), "top1": [m[k] for k in sorted(m) if k.startswith("top1_")], "from": "metrics.jsonl"}  # fmt: skip


def train(a: argparse.Namespace, cmds: dict[str, list[str]], log_path: Path, budget: float, res: dict) -> tuple[int, bool]:
    """``hsstream up --train``, cut after ``budget`` seconds; (its exit code, whether it was cut)."""
    t0 = time.perf_counter()
    with open(log_path, "wb") as fh:
        p = subprocess.Popen(cmds["up"], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=max(1.0, budget)), False
        except subprocess.TimeoutExpired:
            log(f"training cut after {time.perf_counter() - t0:.0f} s (deadline {a.deadline_s} s less "
                f"{a.eval_reserve_s} s for the evaluation)")
            res["up_stopped_cleanly"] = stop_up(p, a.stop_grace_s)
            return p.returncode, True


def run(a: argparse.Namespace, wd: Path, cmds: dict[str, list[str]], clock: Clock, save, res: dict) -> dict:  # noqa: ANN001
    """Fills ``res`` phase by phase (``save`` after each), so what was done survives an exception."""
    res.update({"benchmark": "real_model_gpu", "draft": a.draft, "model": str(a.model), "data": str(a.data),
                "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "commands": {k: shlex.join(v) for k, v in cmds.items()},
                "args": {k: str(v) for k, v in vars(a).items()}, "complete": False})  # fmt: skip
    try:
        import torch

        res["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception as e:  # noqa: BLE001 - a figure for the record only
        res["device"] = f"unknown ({e})"
    save(res)
    # 1. train, cut at the deadline less what the evaluation needs
    run_dir, log_path = wd / a.draft / "run", wd / a.draft / "up.log"
    train_budget = a.train_timeout if a.deadline_s is None else min(a.train_timeout, clock.left(1e9) - a.eval_reserve_s)
    t0 = time.perf_counter()
    if a.eval_only:  # an earlier call on this machine trained in --workdir: serve its newest draft
        rc, cut = 0, None
        res["eval_only"] = True
        earlier = ROOT / "bench" / "results" / f"{a.name or f'real_model_gpu_{a.draft}'}.json"
        if earlier.is_file():  # that call's own figures (the same --name), kept beside this call's
            e = json.loads(earlier.read_text())
            res["training_call"] = {k: e.get(k) for k in ("up_s", "train_cut_at_deadline", "trainer", "wall_s", "error")}
            res["commands"]["up"] = (e.get("commands") or {}).get("up")
    else:
        rc, cut = train(a, cmds, log_path, train_budget, res)
    res["up_s"], res["train_cut_at_deadline"] = round(time.perf_counter() - t0, 1), cut
    res["trainer"] = trainer_figures(run_dir)
    draft, step = trained_draft(run_dir)
    res["trained_draft"] = {"dir": str(draft) if draft else None, "checkpoint_step": step}
    if not cut and rc != 0:
        res["error"] = f"hsstream up exited {rc}: {log_path.read_text(errors='replace')[-3000:]}"
    if draft is None:
        res.setdefault("error", f"no trained draft in {run_dir} (no final/, no checkpoint): see {log_path}")
        res["up_log_tail"] = log_path.read_text(errors="replace")[-3000:]
        save(res)
        return res
    save(res)
    # 2. the untrained draft of the same maps, 3. serve each
    untrained_draft(a, run_dir, wd / a.draft / "untrained-draft")
    cmds["eval_trained"][cmds["eval_trained"].index("--draft") + 1] = str(draft)
    res["commands"]["eval_trained"] = shlex.join(cmds["eval_trained"])
    arms = ["trained", "untrained"]
    if a.untrained_from is not None:  # the same held-out prompts, maps and seed: an earlier call's figures
        earlier = json.loads(a.untrained_from.read_text())
        res["untrained"], res["untrained_from"] = earlier["untrained"], str(a.untrained_from)
        arms.remove("untrained")
        # nor the no-draft baseline (one engine less): the earlier call's, on the same prompts
        cmds["eval_trained"].append("--no-baseline")
        res["commands"]["eval_trained"] = shlex.join(cmds["eval_trained"])
        res["baseline_from"] = {t: (v or {}).get("baseline_tokens_per_s") for t, v in (earlier.get("trained") or {}).items()}
    for arm in arms:
        left = clock.left(a.eval_timeout)
        if left < 20:
            res["error"] = f"deadline: no time left to serve the {arm} draft"
            break
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmds[f"eval_{arm}"], cwd=ROOT, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            res["error"] = f"hsstream eval ({arm}) passed its {left:.0f} s (deadline or --eval-timeout)"
            break
        res[f"eval_{arm}_s"] = round(time.perf_counter() - t0, 1)
        if p.returncode != 0:
            res["error"] = f"hsstream eval ({arm}) exited {p.returncode}: {(p.stderr or p.stdout)[-3000:]}"
            break
        ev = json.loads(p.stdout)
        res[arm] = per_temperature(ev)
        res.setdefault("speculative_config", ev.get("speculative_config"))
        save(res)
    if "trained" in res and "untrained" in res:
        t0_tr, t0_un = res["trained"]["0.0"]["mean_acceptance_length"], res["untrained"]["0.0"]["mean_acceptance_length"]
        res["checks"] = {f"t0_mal_trained_ge_untrained_plus_{MAL_MARGIN}": t0_tr is not None and t0_un is not None
                         and t0_tr >= t0_un + MAL_MARGIN}  # fmt: skip
        res["complete"] = "error" not in res
    return res


def summary(res: dict) -> str:
    """The table printed at the end: per temperature, each arm's mean acceptance length and tokens/s."""
    rows = [f"real model ({res.get('device')}), draft {res['draft']}: " + (
        "complete" if res.get("complete") else f"INCOMPLETE ({(res.get('error') or '')[:200]})")]  # fmt: skip
    tr = res.get("trainer") or {}
    rows.append(f"trainer: {tr.get('steps')} steps, {tr.get('samples_per_s')} samples/s, waiting "
                f"{tr.get('wait_frac')} of its time; cut at the deadline: {res.get('train_cut_at_deadline')}")  # fmt: skip
    rows.append(f"{'T':>4} {'arm':>10} {'mean acc. length':>17} {'tokens/s':>10}")
    temps = sorted(set(res.get("trained", {})) | set(res.get("untrained", {})))
    for t in temps:
        for arm in ("trained", "untrained"):
            v = res.get(arm, {}).get(t)
            if v:
                mal = v["mean_acceptance_length"]
                rows.append(f"{t:>4} {arm:>10} {'-' if mal is None else f'{mal:.3f}':>17} {v['tokens_per_s'] or 0:>10.1f}")
        base = (res.get("trained", {}).get(t) or {}).get("baseline_tokens_per_s")
        rows.append(f"{t:>4} {'none':>10} {'1 (no draft)':>17} {base or 0:>10.1f}")
    for k, v in (res.get("checks") or {}).items():
        rows.append(f"check {k}: {'PASS' if v else 'FAIL'}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", action="store_true", help="print which drafts this vLLM serves, as JSON, and exit")
    ap.add_argument("--make-data", nargs=3, metavar=("SRC", "OUT", "ROWS"),
                    help="write the first ROWS conversations of SRC to OUT (JSONL) and exit")
    ap.add_argument("--model", type=Path, help="the verifier (SmolLM2-135M-Instruct: `hsstream models get smollm2`)")
    ap.add_argument("--data", type=Path, help="ShareGPT conversations (JSON array or JSONL, `sharegpt` preset)")
    ap.add_argument("--draft", default="eagle3")
    ap.add_argument("--mask-token-id", type=int, default=None, help="peagle/dflash/dspark: the mask token (hsstream train's)")
    ap.add_argument("--init-draft", type=Path, default=None,
                    help="warm start (hsstream train --init-draft): a draft an earlier call trained, so a second "
                         "device call trains on for another ~10 min (same maps; the untrained arm keeps them)")
    ap.add_argument("--eval-only", action="store_true",
                    help="no training: serve the newest draft an earlier call trained in --workdir (a call that "
                         "trained to its deadline with --eval-reserve-s 0), and the untrained one")
    ap.add_argument("--untrained-from", type=Path, default=None,
                    help="the untrained arm's figures and the no-draft baseline from an earlier call's JSON on the "
                         "same data (same held-out prompts, maps and seed): one engine instead of three")
    ap.add_argument("--train-samples", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-mem-util", type=float, default=0.4, help="vLLM's share: the trainer uses the same GPU")
    ap.add_argument("--train-timeout", type=float, default=420, help="seconds `hsstream up --train` may take at most")
    ap.add_argument("--eval-timeout", type=float, default=240, help="seconds each `hsstream eval` may take at most")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="end, with the JSON written, within this many seconds of the start: training is cut at "
                         "the deadline less --eval-reserve-s and the newest checkpoint served")
    ap.add_argument("--eval-reserve-s", type=float, default=280,
                    help="with --deadline-s: seconds kept for the untrained draft and the two evaluations (three "
                         "vLLM engines of ~50 s each on an H100: 170 s was too little on 2026-12-05)")
    ap.add_argument("--stop-grace-s", type=float, default=30, help="seconds `hsstream up` has to stop once cut")
    ap.add_argument("--checkpoint-every-s", type=float, default=45,
                    help="the trainer also checkpoints this often: what a cut run is evaluated on")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="the training stack's vLLM without torch.compile/CUDA graphs (starts ~40 s sooner; "
                         "hsstream eval serves eager anyway)")
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
    clock = Clock(a.deadline_s)
    a.model, a.data = a.model.resolve(), a.data.resolve()
    if a.init_draft is not None:
        a.init_draft = a.init_draft.resolve()
    wd = (a.workdir or Path(tempfile.mkdtemp(prefix="hsstream-real-model-"))).resolve()
    (wd / a.draft).mkdir(parents=True, exist_ok=True)
    cmds = commands(a, wd)
    check(a, cmds)
    if a.dry_run:
        for k, v in cmds.items():
            print(f"{k}: {shlex.join(v)}")
        return 0
    name = a.name or f"real_model_gpu_{a.draft}"
    dests = [ROOT / "bench" / "results"] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])

    def save(res: dict) -> None:  # after every phase: a call cut short still brings back what was done
        res["wall_s"] = round(clock.elapsed(), 1)
        for d in dests:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{name}.json.tmp"
            tmp.write_text(json.dumps(res, indent=1) + "\n")
            os.replace(tmp, d / f"{name}.json")

    res: dict = {}
    try:
        run(a, wd, cmds, clock, save, res)
    except Exception as e:  # noqa: BLE001 - written down, with what was done, then raised
        res["error"] = f"{type(e).__name__}: {e}"
        save(res)
        raise
    save(res)
    log(json.dumps({k: res.get(k) for k in ("trainer", "trained", "untrained", "checks", "error")}))
    print(summary(res), flush=True)
    print(f"wrote {', '.join(str(d / (name + '.json')) for d in dests)}", flush=True)
    return 0 if not res.get("error") and all(res.get("checks", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
