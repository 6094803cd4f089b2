#!/usr/bin/env python3
"""The real model, trained online and served faster: SmolLM2-135M-Instruct on ShareGPT (``make demo``).

1. The verifier is ``hsstream models get smollm2``'s checkpoint (the Q4_1 GGUF dequantized to
   bf16: every figure here is of that model), the data ``hsstream data get sharegpt``'s file as
   shipped. Prompts are the first user turn of the file's first conversations (read with the
   streaming JSON reader, stopping long before the file's truncated tail), at most
   ``--max-prompt-tokens`` once chat-formatted, each kept once. Each is held out for evaluation
   or used for training by a hash of its text (``held_out``), and the two sets are checked
   disjoint by the sha256 of each prompt's text and by record id.
2. The real stack (vLLM CPU build with our connector + the sidecar) **regenerates** a reply to
   every training prompt with the verifier (the sidecar's ``mode: regenerate``: EAGLE-3's and
   speculators' recipe; a share greedy, the rest sampled at T=1), and ``hsstream train`` trains
   an Eagle-3 draft online from the hidden states of prompt + reply (loss on the reply), one
   pass, no ``--steps``: the run ends when every sample is consumed. Its draft vocabulary is the
   ``--draft-vocab-size`` most frequent tokens of the training conversations' own (ShareGPT)
   replies, a ``--token-counts`` file the trainer builds its frequency-ranked map from (the
   regenerated replies do not exist before training starts).
3. ``hsstream eval`` serves the verifier in vLLM with the trained draft, with an untrained one
   (same architecture and vocabulary maps) and without a draft, on the held-out prompts (chat
   formatted), 3 speculative tokens, T=0 and T=1: acceptance rate, mean acceptance length and
   tokens/s, from the requests' records beside vLLM's counters.

Exits non-zero, naming each miss, if the trained draft's mean acceptance length at T=0 is not at
least ``--margin`` above the untrained one's, if a sample was lost (every sample of every job
consumed, none failed), if a file or slot is left in the spool, if the held-out prompts are not
disjoint from the training ones, or if the two sources of the eval's figures disagree.

    python bench/served_acceptance/real_acceptance.py --workdir .demo/real --out .demo/real_acceptance.json   # make demo
    python bench/served_acceptance/real_acceptance.py                     # make real-acceptance: bench/results/real_acceptance_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.online_vs_offline import ovo_regimes as R  # noqa: E402
from bench.served_acceptance.acceptance import RUN_DIR_NAME, log, verdict, write_result  # noqa: E402

OUT_DEFAULT = ROOT / "bench" / "results" / "real_acceptance_cpu.json"
USER_SPEAKERS = ("human", "user")
REPLY_SPEAKERS = ("gpt", "chatgpt", "bing", "bard", "assistant")


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def held_out(text: str, one_in: int) -> bool:
    """The split: a prompt is held out for evaluation when its text's hash says so (one in ``one_in``)."""
    return int(text_hash("eval:" + text)[:8], 16) % one_in == 0


def chat_ids(tok, prompt: str) -> list[int]:  # noqa: ANN001
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def select_prompts(path: Path, tok, *, n_train: int, n_eval: int, max_prompt_tokens: int, one_in: int,  # noqa: ANN001
                   max_records: int) -> dict:  # fmt: skip
    """Training and held-out prompts from the ShareGPT file's first records (module docstring, 1.)."""
    from trainer_client.data_sources import iter_json_array

    train: list[dict] = []
    evals: list[dict] = []
    seen: set[str] = set()
    skipped: dict[str, int] = {}
    records = 0

    def skip(why: str) -> None:
        skipped[why] = skipped.get(why, 0) + 1

    for row in iter_json_array(path):  # stops long before the file's cut (max_records)
        if records >= max_records or (len(train) >= n_train and len(evals) >= n_eval):
            break
        records += 1
        turns = row.get("conversations")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
            skip("no conversation")
            continue
        first = turns[0]
        if first.get("from") not in USER_SPEAKERS:
            skip("does not start with a user turn")
            continue
        prompt = first.get("value")
        if not isinstance(prompt, str) or not prompt.strip():
            skip("empty first turn")
            continue
        prompt = prompt.strip()
        h = text_hash(prompt)
        if h in seen:
            skip("duplicate prompt")
            continue
        ids = chat_ids(tok, prompt)
        if len(ids) > max_prompt_tokens:
            skip(f"prompt over {max_prompt_tokens} tokens")
            continue
        reply = next((t.get("value") for t in turns[1:2] if isinstance(t, dict) and t.get("from") in REPLY_SPEAKERS), None)
        item = {"id": str(row.get("id", records)), "prompt": prompt, "sha256": h, "prompt_tokens": len(ids),
                "reply": reply if isinstance(reply, str) else None}  # fmt: skip
        dest, cap = (evals, n_eval) if held_out(prompt, one_in) else (train, n_train)
        if len(dest) < cap:
            seen.add(h)
            dest.append(item)
        else:
            skip("its side of the split is full")
    return {"train": train, "eval": evals, "records_read": records, "skipped": skipped}


def disjointness(train: list[dict], evals: list[dict]) -> dict:
    th, eh = {t["sha256"] for t in train}, {e["sha256"] for e in evals}
    ti, ei = {t["id"] for t in train}, {e["id"] for e in evals}

    def digest(hs: set[str]) -> str:
        return hashlib.sha256("\n".join(sorted(hs)).encode()).hexdigest()

    return {"train_prompts": len(train), "eval_prompts": len(evals), "common_prompt_hashes": len(th & eh),
            "common_record_ids": len(ti & ei), "train_hashes_sha256": digest(th), "eval_hashes_sha256": digest(eh)}  # fmt: skip


def reply_token_counts(tok, train: list[dict]) -> dict[int, int]:  # noqa: ANN001
    """Counts of the tokens of the training conversations' own replies (what the draft vocabulary
    is ranked by), each reply encoded as the chat template renders an assistant turn's text."""
    from collections import Counter

    c: Counter[int] = Counter()
    for t in train:
        if t["reply"]:
            c.update(tok(t["reply"], add_special_tokens=False)["input_ids"])
    c[tok.convert_tokens_to_ids("<|im_end|>")] += len(train)  # every reply ends with it
    return dict(c)


def eval_prompts_file(tok, evals: list[dict], path: Path) -> None:  # noqa: ANN001
    """The held-out prompts as ``hsstream eval --prompts`` takes them: chat-formatted text whose
    tokens (as vLLM encodes a text prompt) are exactly the chat template's."""
    with open(path, "w") as f:
        for e in evals:
            text = tok.apply_chat_template([{"role": "user", "content": e["prompt"]}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
            if tok(text, add_special_tokens=True)["input_ids"] != chat_ids(tok, e["prompt"]):
                raise RuntimeError(f"held-out prompt {e['id']}: its text does not encode to the chat template's tokens")
            f.write(json.dumps({"prompt": text}) + "\n")


def train_online(verifier: str, stack, jobs: list[str], wd: Path, *, draft_vocab_size: int, lr: float, seed: int,  # noqa: ANN001
                 counts_file: Path, cores: list[int]) -> tuple[list[str], int, dict | None, float]:  # fmt: skip
    """``hsstream train`` on ``jobs`` into WD/draft-run (replaced: an earlier run's followed jobs of a
    sidecar that is gone) until every sample is consumed, its log shown as it goes (and kept in
    WD/train.log); the command, exit status, summary and wall time."""
    run_dir = wd / RUN_DIR_NAME
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "hsstream", "train", "--model", verifier, "--out", str(run_dir),
           *[x for j in jobs for x in ("--job", j)], "--api", stack.api, "--endpoint", stack.delivery_endpoint,
           "--spool", str(stack.spool), "--draft-vocab-size", str(draft_vocab_size), "--token-counts", str(counts_file),
           "--lr", str(lr), "--seed", str(seed), "--checkpoint-every", "1000", "--log-every", "20", "--no-progress"]  # fmt: skip
    log("training: hsstream " + " ".join(cmd[3:]))
    t0 = time.perf_counter()
    with open(wd / "train.log", "w") as logf:
        p = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=stack.client_env(),
                             preexec_fn=lambda: os.sched_setaffinity(0, cores))  # fmt: skip
        try:
            out: list[str] = []
            reader = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)  # type: ignore[union-attr]
            reader.start()
            for line in p.stderr:  # type: ignore[union-attr]
                logf.write(line)
                if " step " in line or "draft vocabulary" in line or "error" in line.lower() or "Traceback" in line:
                    print("  train | " + line.rstrip()[-200:], flush=True)
            rc = p.wait()
            reader.join()
        finally:  # interrupted: the trainer stops too (it says what it saved), before the stack does
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=120)
    wall = time.perf_counter() - t0
    text = "".join(out)
    return cmd, rc, json.loads(text[text.index("{") :]) if rc == 0 and "{" in text else None, wall


def hsstream_eval(verifier: str, draft: Path, prompts: Path, wd: Path, name: str, *, max_tokens: int,
                  baseline: bool, dtype: str) -> tuple[dict, float, list[str]]:  # fmt: skip
    """``hsstream eval ... --json`` as a user runs it; its result, wall time and command."""
    cmd = [sys.executable, "-m", "hsstream", "eval", "--draft", str(draft), "--model", verifier, "--prompts", str(prompts),
           "--temperature", "0", "--temperature", "1", "--max-tokens", str(max_tokens), "--workdir", str(wd / name),
           "--dtype", dtype, "--json", *([] if baseline else ["--no-baseline"])]  # fmt: skip
    log(f"hsstream eval ({name}): " + " ".join(cmd[3:]))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"hsstream eval ({name}) failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout), wall, ["hsstream", *cmd[3:]]


def figures(res: dict, t: str) -> dict:
    v = res["temperatures"][t]
    m = v["vllm_metrics"]
    return {"acceptance_rate": m["acceptance_rate"], "mean_acceptance_length": m["mean_acceptance_length"],
            "acceptance_per_position": m["acceptance_per_position"], "drafts": m["drafts"],
            "ours_mean_acceptance_length": v["ours"]["mean_acceptance_length"],
            "tokens_per_s_with_draft": v["tokens_per_s"]["with_draft"],
            "tokens_per_s_without_draft": v["tokens_per_s"]["without_draft"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0915
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="verifier: short name or checkpoint dir")
    ap.add_argument("--data", default="sharegpt", help="dataset short name (hsstream data get) or a ShareGPT JSON file")
    ap.add_argument("--train-prompts", type=int, default=320)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--held-out-one-in", type=int, default=8, help="a prompt is held out when its hash says so, one in N")
    ap.add_argument("--max-records", type=int, default=4000, help="read at most this many records of the file")
    ap.add_argument("--max-prompt-tokens", type=int, default=160, help="longest chat-formatted prompt kept")
    ap.add_argument("--reply-tokens", type=int, default=128, help="the regenerated replies' max_tokens")
    ap.add_argument("--greedy-share", type=float, default=0.75, help="share of training replies generated at T=0 (rest T=1)")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0, help="the trainer's seed")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per held-out prompt by hsstream eval")
    ap.add_argument("--margin", type=float, default=0.5, help="trained minus untrained mean acceptance length at T=0, at least")
    ap.add_argument("--dtype", default=None, help="vLLM's --dtype for the verifier (default: bfloat16 where the CPU has "
                                                   "native bf16, else float32, several times faster there)")  # fmt: skip
    ap.add_argument("--workdir", default=None, help="logs, drafts and eval results (default: a new temp dir); its "
                                                    f"{RUN_DIR_NAME}/ is replaced by each run")  # fmt: skip
    ap.add_argument("--out", default=str(OUT_DEFAULT))
    a = ap.parse_args(argv)
    # SIGTERM unwinds through the finally blocks as Ctrl-C does (a background job of a shell
    # ignores SIGINT): the trainer and the stack stop and the spool goes, rather than left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch
    from transformers import AutoTokenizer

    from hsstream import assets, launch
    from hsstream.devstack import Stack
    from hsstream.evaluate import agreement, print_table
    from trainer_client.drafts import eagle3 as E3
    from trainer_client.train import vocab as V

    t_all = time.perf_counter()
    load_start = os.getloadavg()
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="hsstream-real-")).absolute()
    wd.mkdir(parents=True, exist_ok=True)
    log(f"workdir {wd}")
    phases: dict[str, float] = {}

    # -- 1. model, data, prompts ---------------------------------------------------------------
    t0 = time.perf_counter()
    verifier = str(assets.get_model(a.model) if a.model in assets.MODELS else Path(a.model).absolute())
    data = assets.get_dataset(a.data) if a.data in assets.DATASETS else Path(a.data)
    tok = AutoTokenizer.from_pretrained(verifier)
    sel = select_prompts(data, tok, n_train=a.train_prompts, n_eval=a.eval_prompts, max_prompt_tokens=a.max_prompt_tokens,
                         one_in=a.held_out_one_in, max_records=a.max_records)  # fmt: skip
    train, evals = sel["train"], sel["eval"]
    split = disjointness(train, evals)
    log(f"{sel['records_read']} ShareGPT records read: {len(train)} training prompts, {len(evals)} held out; "
        f"skipped {sel['skipped']}; common hashes {split['common_prompt_hashes']}, common ids {split['common_record_ids']}")  # fmt: skip
    counts_file = wd / "reply_token_counts.json"
    counts = reply_token_counts(tok, train)
    V.save_token_counts(counts, counts_file)
    prompts_file = wd / "held_out_prompts.jsonl"
    eval_prompts_file(tok, evals, prompts_file)
    n = launch.num_hidden_layers(verifier)
    assert n is not None
    layers = launch.default_layer_ids(n)
    # the rule every vLLM we start follows (float32 where bf16 is emulated), else the checkpoint's own
    dtype = a.dtype or launch.cpu_serving_dtype(verifier) or launch.model_dtype(verifier) or "auto"
    split_cores = R.split_cores(os.sched_getaffinity(0))  # vLLM + sidecar | trainer, while training
    log(f"vLLM serves the verifier in {dtype}; while training, vLLM and the sidecar on cores {split_cores['producer']}, "
        f"the trainer on {split_cores['trainer']}")  # fmt: skip
    phases["prepare"] = time.perf_counter() - t0

    # -- 2. stream (regenerated replies) + train -----------------------------------------------
    n_greedy = round(len(train) * a.greedy_share)
    parts = [(0.0, train[:n_greedy]), (1.0, train[n_greedy:])]
    stack = Stack(verifier, layers, wd, max_model_len=1024, vllm_extra=["--dtype", dtype])
    stack.env["VLLM_CPU_OMP_THREADS_BIND"] = R.omp_bind(split_cores["producer"])
    t0 = time.perf_counter()
    jobs, job_specs = [], []
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, split_cores["producer"])  # the stack's processes inherit it
        try:
            stack.start()
        finally:
            os.sched_setaffinity(0, before)
        phases["stack_start"] = time.perf_counter() - t0
        log(f"stack up in {phases['stack_start']:.0f} s (vLLM CPU build + our connector + sidecar), layers {layers}")
        with stack.client(timeout=120) as c:
            for temp, part in parts:
                if not part:
                    continue
                opts = {"mode": "regenerate", "on_invalid": "skip",
                        "sampling": {"max_tokens": a.reply_tokens, "temperature": temp, "seed": 7}}  # fmt: skip
                r = c.create_job([{"id": t["id"], "messages": [{"role": "user", "content": t["prompt"]}]} for t in part], opts)
                jobs.append(r.job_id)
                job_specs.append({"job": r.job_id, "samples": len(part), "queued": r.num_samples,
                                  "refused_at_submission": r.num_failed_at_submission, "options": opts})  # fmt: skip
        cmd, rc, train_res, t_train = train_online(verifier, stack, jobs, wd, draft_vocab_size=a.draft_vocab_size, lr=a.lr,
                                                   seed=a.seed, counts_file=counts_file, cores=split_cores["trainer"])  # fmt: skip
        phases["train"] = t_train
        if train_res is None:
            log(f"training failed ({rc}): see {wd / 'train.log'}")
            return 1
        with stack.client(timeout=30) as c:
            status = [c.job(j) for j in jobs]
        time.sleep(0.5)  # the trainer's last acks and deletions
        left, slots = stack.spool_files(), stack.held_slots()
    finally:
        stack.stop()
        stack.remove_spool()
    queued = sum(s["queued"] for s in job_specs)
    consumed = sum(s.counts.get("consumed", 0) for s in status)
    failed = sum(s.counts.get("failed", 0) for s in status)
    stream = {"jobs": job_specs, "queued": queued, "consumed": consumed, "failed": failed,
              "tokens_consumed": sum(s.tokens_consumed for s in status), "spool_files_left": left,
              "arena_slots_held": slots, "counts": [s.counts for s in status]}  # fmt: skip
    log(f"trained {train_res['steps']} steps on {train_res['samples']} samples ({train_res['tokens']} tokens) in "
        f"{t_train:.0f} s, waiting for data {train_res['wait_s']:.0f} s; top-1 per TTT step "
        f"{[round(x, 3) for x in train_res['top1']]}; consumed {consumed}/{queued}, failed {failed}, spool left {left}")  # fmt: skip

    # -- untrained draft: same architecture, same maps -------------------------------------------
    run_dir = wd / RUN_DIR_NAME
    maps = torch.load(run_dir / "vocab_maps.pt", weights_only=True)
    untrained_dir = wd / "untrained-draft"
    shutil.rmtree(untrained_dir, ignore_errors=True)
    E3.build_draft(verifier, layers[:3], draft_vocab_size=maps["draft_vocab_size"], t2d=maps["t2d"], d2t=maps["d2t"],
                   seed=1).save_pretrained(untrained_dir)  # fmt: skip
    coverage = V.coverage(counts, maps["t2d"])

    # -- 3. serve ---------------------------------------------------------------------------------
    t0 = time.perf_counter()
    trained_res, w_tr, eval_cmd = hsstream_eval(verifier, Path(train_res["final_dir"]), prompts_file, wd, "eval-trained",
                                                max_tokens=a.max_tokens, baseline=True, dtype=dtype)  # fmt: skip
    untrained_res, w_un, _ = hsstream_eval(verifier, untrained_dir, prompts_file, wd, "eval-untrained",
                                           max_tokens=a.max_tokens, baseline=False, dtype=dtype)  # fmt: skip
    phases["eval"] = time.perf_counter() - t0
    print_table(trained_res)
    print_table(untrained_res)

    acc = {name: {f"T{t[0]}": figures(r, t) for t in ("0.0", "1.0")} for name, r in (("trained", trained_res),
                                                                                        ("untrained", untrained_res))}  # fmt: skip
    tr0, un0 = acc["trained"]["T0"]["mean_acceptance_length"], acc["untrained"]["T0"]["mean_acceptance_length"]
    gap = max(agreement(trained_res), agreement(untrained_res))
    checks = {
        f"trained_t0_mean_acceptance_length_ge_untrained_plus_{a.margin:g}": (tr0 or 0) - (un0 or 0) >= a.margin,
        "no_sample_lost": failed == 0 and consumed == queued == len(train)
        and all(s["refused_at_submission"] == 0 for s in job_specs),
        "spool_empty": not left and slots == 0,
        "held_out_disjoint_from_training": split["common_prompt_hashes"] == 0 and split["common_record_ids"] == 0
        and len(evals) == a.eval_prompts,
        "eval_sources_agree": gap <= 1e-9,
    }  # fmt: skip
    phases["total"] = time.perf_counter() - t_all
    result = {
        "benchmark": "real_model_acceptance_cpu",
        "command": "python bench/served_acceptance/real_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "train_command": "hsstream " + " ".join(cmd[3:]),
        "eval_command": " ".join(eval_cmd),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "verifier": {"path": verifier, "name": a.model, "layers": layers, "served_dtype": dtype, "cores": split_cores,
                     "note": "SmolLM2-135M-Instruct's Q4_1 GGUF dequantized to bf16 (hsstream models get smollm2)"},  # fmt: skip
        "data": {"file": str(data), "records_read": sel["records_read"], "skipped": sel["skipped"], "split": split,
                 "max_prompt_tokens": a.max_prompt_tokens, "held_out_one_in": a.held_out_one_in,
                 "train_prompt_tokens_mean": round(sum(t["prompt_tokens"] for t in train) / max(1, len(train)), 1)},  # fmt: skip
        "mode": {"name": "regenerate", "reply_tokens": a.reply_tokens, "greedy_share": a.greedy_share,
                 "why": "EAGLE-3's and speculators' recipe: the draft learns the verifier's own replies, what it faces when served"},  # fmt: skip
        "training": {**train_res, "train_wall_s": round(t_train, 1), "lr": a.lr, "draft_vocab_size": maps["draft_vocab_size"],
                     "draft_vocab_coverage_of_reply_tokens": round(coverage, 4),
                     "tokens_per_s": round(train_res["tokens"] / max(1e-9, train_res["wall_s"]), 1)},  # fmt: skip
        "stream": stream,
        "serving": {"num_speculative_tokens": trained_res["num_speculative_tokens"], "prompts": len(evals),
                    "max_tokens": a.max_tokens, "trained": trained_res, "untrained": untrained_res,
                    "wall_s": {"trained_and_no_draft": round(w_tr, 1), "untrained": round(w_un, 1)}},  # fmt: skip
        "acceptance": acc,
        "margin": {"required": a.margin, "measured_t0": round((tr0 or 0) - (un0 or 0), 3)},
        "checks": checks,
        "passed": all(checks.values()),
        "wall_s": {k: round(v, 1) for k, v in phases.items()},
    }
    write_result(result, a.out)
    print(f"\n{'draft':<11}{'MAL T=0':>9}{'rate T=0':>10}{'tok/s T=0':>11}{'MAL T=1':>9}{'rate T=1':>10}{'tok/s T=1':>11}")
    for name in ("trained", "untrained"):
        f0, f1 = acc[name]["T0"], acc[name]["T1"]
        print(f"{name:<11}{f0['mean_acceptance_length']:>9.3f}{f0['acceptance_rate']:>10.3f}{f0['tokens_per_s_with_draft']:>11.1f}"
              f"{f1['mean_acceptance_length']:>9.3f}{f1['acceptance_rate']:>10.3f}{f1['tokens_per_s_with_draft']:>11.1f}")  # fmt: skip
    nd = acc["trained"]
    print(f"{'no draft':<11}{'':>9}{'':>10}{nd['T0']['tokens_per_s_without_draft']:>11.1f}{'':>9}{'':>10}"
          f"{nd['T1']['tokens_per_s_without_draft']:>11.1f}")  # fmt: skip
    print(f"margin at T=0: {result['margin']['measured_t0']:+.3f} (required {a.margin:+.2f}); {len(train)} regenerated samples, "
          f"{train_res['tokens']} tokens trained in {t_train:.0f} s; total {phases['total'] / 60:.1f} min -> {a.out}")  # fmt: skip
    return verdict(checks)


if __name__ == "__main__":
    raise SystemExit(main())
