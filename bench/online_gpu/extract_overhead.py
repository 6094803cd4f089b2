#!/usr/bin/env python3
"""Extraction overhead: plain vLLM vs vLLM + our connector vs vLLM + vLLM's Example connector.

The three configurations run interleaved (A B C A B C ...), one engine per process, in one
invocation, so the ratios compare like with like on a noisy machine. Our connector's files
are consumed as they come: a thread receives each ZeroMQ notice and deletes the file, as a
same-host trainer would. Prints a table and writes JSON to bench/results/ (and $OUT).

GPU (H200, vLLM 0.26 bundle):  python bench/online_gpu/extract_overhead.py
CPU smoke (tiny model):        python bench/online_gpu/extract_overhead.py --tiny --n-prompts 16 --prompt-len 128 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MODES = ("plain", "ours", "example")


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def model_dir(args: argparse.Namespace) -> tuple[str, list[int], bool]:
    if args.tiny:
        from hsstream.tiny_model import build_tiny_verifier

        return str(build_tiny_verifier()), [2, 6, 9, 12], False
    d = Path(args.model_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(QWEN3_8B))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151645}))
    return str(d), [2, 18, 33, 36], True


def prompts(n: int, plen: int, vocab: int, seed: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lo = 0 if vocab < 2000 else 1000
    return [{"prompt_token_ids": r.tolist()} for r in rng.integers(lo, vocab - 8, size=(n, plen))]


class NoticeConsumer:
    """Stands in for a same-host trainer: deletes each file as its notice arrives."""

    def __init__(self, endpoint: str, spool: Path) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.bind(endpoint)
        self.spool = spool
        self.count = self.errors = self.nbytes = 0
        self.keep = False  # True: leave the files (for checks that read them afterwards)
        self.notices: list = []  # with keep: every notice received, to check each file came once
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self) -> None:
        from connector import protocol as P

        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            n = P.Notice.decode(self.sock.recv())
            if n.status != P.NoticeStatus.ok or n.file is None:
                self.errors += 1
                continue
            p = P.resolve_in_spool(self.spool, n.file)
            self.nbytes += p.stat().st_size
            if self.keep:
                self.notices.append(n)
            else:
                p.unlink()
            self.count += 1

    def wait(self, n: int, timeout: float) -> float | None:
        t0 = time.perf_counter()
        while self.count + self.errors < n:
            if time.perf_counter() - t0 > timeout:
                return None
            time.sleep(0.005)
        return time.perf_counter() - t0


def run_one(args: argparse.Namespace) -> dict:
    """One configuration in this process (vLLM engines do not share a process well)."""
    from vllm import LLM, SamplingParams

    import vllm
    from hsstream import launch

    mdir, layers, dummy = model_dir(args)
    res: dict = {"mode": args.mode, "round": args.round, "vllm": vllm.__version__, "layers": layers, "tp": args.tp}
    spool = Path(args.spool) / args.mode
    shutil.rmtree(spool, ignore_errors=True)
    kw: dict = dict(
        model=mdir, dtype="bfloat16", max_model_len=args.max_model_len, enable_prefix_caching=False,
        enforce_eager=not args.compile, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, seed=0, gpu_memory_utilization=args.gpu_mem_util,
        tensor_parallel_size=args.tp,
    )  # fmt: skip
    if dummy:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    consumer = None
    if args.mode != "plain":
        spool.mkdir(parents=True)
        kw["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        }
    if args.mode == "ours":
        ep = f"ipc:///tmp/hsstream-bench-{os.getpid()}.sock"
        consumer = NoticeConsumer(ep, spool)
        opts = launch.VllmOptions(model=mdir, layer_ids=layers, spool_dir=str(spool), notice_endpoint=ep,
                                  num_writer_threads=8)  # fmt: skip
        kw["speculative_config"], kw["kv_transfer_config"] = launch.extraction_configs(opts)
    elif args.mode == "example":
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(spool)},
        }
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    vocab = 512 if args.tiny else QWEN3_8B["vocab_size"]
    llm.generate(prompts(args.warmup, args.prompt_len, vocab, 123), sp, use_tqdm=False)
    if consumer:
        consumer.wait(args.warmup, 120)
        consumer.count = consumer.errors = consumer.nbytes = 0
    elif args.mode == "example":
        time.sleep(1.0)
        shutil.rmtree(spool, ignore_errors=True)
        spool.mkdir(parents=True)
    ps = prompts(args.n_prompts, args.prompt_len, vocab, 0)
    ntok = args.n_prompts * args.prompt_len
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    res.update(n_prompts=args.n_prompts, prompt_len=args.prompt_len, prompt_tokens=ntok, generate_s=round(dt, 3))
    res["prompt_tok_per_s"] = round(ntok / dt, 1)
    if consumer:
        wdt = consumer.wait(args.n_prompts, 300)
        res["files_wait_s"] = None if wdt is None else round(wdt, 3)
        res["tok_per_s_incl_files"] = None if wdt is None else round(ntok / (dt + wdt), 1)
        res.update(files=consumer.count, file_errors=consumer.errors, bytes=consumer.nbytes)
        res["bytes_per_token"] = round(consumer.nbytes / ntok, 1)
        res["spool_left"] = len(os.listdir(spool))
        res["kv_transfer_params0"] = outs[0].kv_transfer_params
    elif args.mode == "example":
        t1 = time.perf_counter()
        while sum(1 for f in os.listdir(spool) if f.endswith(".safetensors")) < args.n_prompts:
            if time.perf_counter() - t1 > 300:
                break
            time.sleep(0.01)
        res["files_wait_s"] = round(time.perf_counter() - t1, 3)
        res["tok_per_s_incl_files"] = round(ntok / (dt + res["files_wait_s"]), 1)
    log(f"{args.mode} round {args.round}: {res['prompt_tok_per_s']:,.0f} tok/s")
    # Stop the engine's processes before this one exits: os._exit would orphan them.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        res["shutdown_error"] = repr(e)[:300]
    if consumer:
        consumer.stop.set()
    shutil.rmtree(spool, ignore_errors=True)
    return res


def parent(args: argparse.Namespace) -> int:
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.tiny and Path("/dev/shm").exists():
        # Guest RAM grows on first touch: touch it once so no configuration pays for it.
        log("pre-touching /dev/shm")
        subprocess.run(["dd", "if=/dev/zero", "of=/dev/shm/warm", "bs=1M", f"count={args.warm_shm_mib}"],
                       capture_output=True)  # fmt: skip
        os.unlink("/dev/shm/warm")
    from hsstream import launch

    # CPU build: bind OpenMP threads explicitly, else plain and extraction bind differently.
    env = launch.cpu_env(ranks=args.tp) if args.tiny else dict(os.environ)
    results = []
    for r in range(args.rounds):
        for mode in args.modes:
            jl = Path(args.spool) / f"result-{mode}-{r}.json"
            jl.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, "--child", "--mode", mode, "--round", str(r), "--result", str(jl)]
            cmd += [a for a in sys.argv[1:] if a != "--child"]
            log("run", mode, "round", r)
            p = subprocess.Popen(cmd, env=env, start_new_session=True)
            try:
                rc = p.wait(args.child_timeout)
            except subprocess.TimeoutExpired:
                rc = -9
            finally:  # whatever the engine left behind goes with its process group
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if rc != 0 or not jl.exists():
                results.append({"mode": mode, "round": r, "ok": False, "rc": rc})
                continue
            results.append({**json.loads(jl.read_text()), "ok": True})
    rows = []
    for mode in args.modes:
        rs = [x for x in results if x["mode"] == mode and x.get("ok")]
        if not rs:
            rows.append({"mode": mode, "ok": False})
            continue
        tps = [x["prompt_tok_per_s"] for x in rs]
        inc = [x.get("tok_per_s_incl_files") or x["prompt_tok_per_s"] for x in rs]
        rows.append({"mode": mode, "ok": True, "tok_per_s_mean": round(statistics.mean(tps), 1),
                     "tok_per_s_incl_files_mean": round(statistics.mean(inc), 1), "runs": len(rs)})  # fmt: skip
    plain = next((r for r in rows if r["mode"] == "plain" and r["ok"]), None)
    # Per-round ratios: each extraction run divided by the plain run of the same round.
    for row in rows:
        if not row["ok"] or plain is None:
            continue
        ratios, ratios_inc = [], []
        for r in range(args.rounds):
            p = next((x for x in results if x["mode"] == "plain" and x["round"] == r and x.get("ok")), None)
            m = next((x for x in results if x["mode"] == row["mode"] and x["round"] == r and x.get("ok")), None)
            if p and m:
                ratios.append(m["prompt_tok_per_s"] / p["prompt_tok_per_s"])
                ratios_inc.append((m.get("tok_per_s_incl_files") or m["prompt_tok_per_s"]) / p["prompt_tok_per_s"])
        row["ratio_to_plain"] = round(statistics.mean(ratios), 4) if ratios else None
        row["ratio_incl_files"] = round(statistics.mean(ratios_inc), 4) if ratios_inc else None
    print("\n| configuration | prompt tok/s | ÷ plain | incl. files on /dev/shm | ÷ plain |")
    print("|---|---|---|---|---|")
    for row in rows:
        if row["ok"]:
            print(f"| {row['mode']} | {row['tok_per_s_mean']:,.0f} | {row.get('ratio_to_plain')} | "
                  f"{row['tok_per_s_incl_files_mean']:,.0f} | {row.get('ratio_incl_files')} |")  # fmt: skip
        else:
            print(f"| {row['mode']} | FAILED | | | |")
    doc = {
        "benchmark": "extract_overhead",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "device": _device(),
        "cpu_threads_bind": env.get("VLLM_CPU_OMP_THREADS_BIND"),
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "mode", "round", "result")},
        "summary": rows,
        "runs": results,
    }
    name = args.name or ("extract_overhead_tiny_cpu.json" if args.tiny else "extract_overhead_h200.json")
    for d in [out_dir, Path(os.environ["OUT"])] if os.environ.get("OUT") else [out_dir]:
        (d / name).write_text(json.dumps(doc, indent=1, default=str))
    log("wrote", out_dir / name)
    return 0 if all(r["ok"] for r in rows) else 1


def _device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip() or "cpu"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--result")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="embedded tiny model (CPU smoke run)")
    ap.add_argument("--n-prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-mem-util", type=float, default=None, help="default 0.85 (GPU), 0.2 (--tiny, CPU)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    ap.add_argument("--spool", default="/dev/shm/hsstream-bench")
    ap.add_argument("--model-dir", default="/tmp/qwen3_8b_dummy")
    ap.add_argument("--warm-shm-mib", type=int, default=20480)
    ap.add_argument("--child-timeout", type=int, default=400)
    ap.add_argument("--name", default=None, help="result file name under bench/results/")
    args = ap.parse_args()
    if args.gpu_mem_util is None:
        args.gpu_mem_util = 0.2 if args.tiny else 0.85
    if args.child:
        res = run_one(args)
        Path(args.result).write_text(json.dumps(res, default=str))
        sys.stdout.flush()
        os._exit(0)
    try:
        return parent(args)
    finally:
        shutil.rmtree(args.spool, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
