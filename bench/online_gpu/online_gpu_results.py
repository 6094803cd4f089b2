"""``bench/online_gpu/online_gpu.py``'s result file: its header, its summary table, writing it.

One JSON under ``bench/results/`` (and ``$OUT`` when set), rewritten after every
configuration, so a run stopped half-way still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.online_gpu.online_gpu_config import ROOT, vllm_flags
from bench.online_gpu.online_gpu_stats import FIRST, WINDOW, floor_ms

OUT_DIR = ROOT / "bench" / "results"


def result_name(args: argparse.Namespace) -> str:
    """The result file's name (``--name``, with ``.json`` added to a bare one)."""
    name = args.name or ("online_gpu_smoke_cpu.json" if args.smoke else "online_gpu_h200x2.json")
    return name if name.endswith(".json") else f"{name}.json"  # a bare name still lands as JSON


def describe(args: argparse.Namespace, shape: dict) -> dict:
    """The result's header: the command, the device, the split, the model, the arguments."""
    n = shape["num_hidden_layers"]
    return {
        "benchmark": "online_gpu", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(["python bench/online_gpu/online_gpu.py", *sys.argv[1:]]), "device": _gpu_names(),
        "split": {"vllm_gpus": args.vllm_gpu_list, "trainer_gpus": args.trainer_gpu_list, "vllm_tp": args.vllm_tp,
                  "vllm_flags": vllm_flags(args)},
        "model": {"shape": "smoke" if args.smoke else "Qwen3-8B", "hidden_size": shape["hidden_size"],
                  "num_hidden_layers": n, "vocab_size": shape["vocab_size"], "layers": args.layers,
                  "vllm_weights": "load_format=dummy", "trainer_reads": "random embed_tokens / norm / lm_head"},
        "args": {k: v for k, v in vars(args).items() if k not in ("consumer",)},
        "window": f"steady state: completions from the {WINDOW[0]:.0%} to the {WINDOW[1]:.0%} quantile "
                  f"(latency also over every sample: 'all', and each job's first {FIRST}: 'first_{FIRST}')",
        "runs": [], "errors": [],
    }  # fmt: skip


def save(doc: dict, name: str) -> None:
    for d in [OUT_DIR] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(doc, indent=1, default=str))


def summarize(doc: dict) -> None:
    runs = doc["runs"]

    def mean(cfg: str, get) -> float | None:  # noqa: ANN001
        xs = [get(r) for r in runs if r["config"] == cfg]
        xs = [x for x in xs if x is not None]
        return round(statistics.mean(xs), 4) if xs else None

    plain = mean("plain", lambda r: r["rate"].get("tok_per_s"))
    s = {
        "plain_tok_per_s": plain,
        "stream_delivered_tok_per_s": mean("stream", lambda r: r["delivered_to_trainer_gpu"].get("tok_per_s")),
        "stream_ratio_to_plain": mean("stream", lambda r: r.get("ratio_to_plain")),
        "stream_vllm_ratio_to_plain": mean("stream", lambda r: r.get("vllm_ratio_to_plain")),
        # Notice -> trainer GPU of "stream": over the steady-state window, and over every sample.
        "latency_p50_ms": mean("stream", lambda r: r["latency_notice_to_gpu_ms"]["p50"]),
        "latency_p99_ms": mean("stream", lambda r: r["latency_notice_to_gpu_ms"]["p99"]),
        "latency_all_p50_ms": mean("stream", lambda r: _all(r, "p50")),
        "latency_all_p99_ms": mean("stream", lambda r: _all(r, "p99")),
        "latency_all_max_ms": mean("stream", lambda r: _all(r, "max")),
        "ordered_latency_p50_ms": mean("stream_ordered", lambda r: r["latency_notice_to_gpu_ms"]["p50"]),
        "ordered_latency_p99_ms": mean("stream_ordered", lambda r: r["latency_notice_to_gpu_ms"]["p99"]),
        # The floor: one sample from tmpfs onto the GPU, alone, the faster of the two ways measured.
        "floor_ms": mean("stream", floor_ms),
        "train_samples_per_s": mean("train", lambda r: r.get("trainer_samples_per_s_overall")),
        "train_tokens_per_s": mean("train", lambda r: r.get("trainer_tokens_per_s_overall")),
        "train_wait_frac": mean("train", lambda r: r["trainer"].get("wait_frac")),
        "train_vllm_ratio_to_plain": mean("train", lambda r: r.get("vllm_ratio_to_plain")),
        "train_bound_by": next((r["bound_by"] for r in runs if r["config"] == "train"), None),
        "train_device_used": next((r["trainer"].get("device_used") for r in runs if r["config"] == "train"), None),
        # Files only: the arena is one file of the budget's size from the start.
        "peak_spool_bytes": max((r["spool"]["peak_bytes"] for r in runs if "spool" in r
                                 and r.get("spool_layout", "files") == "files"), default=None),
        "spool_budget_bytes": next((r["spool"]["budget_bytes"] for r in runs if "spool" in r), None),
        "kv_cache_tokens_plain": next((r["kv_cache_tokens"] for r in runs if r["config"] == "plain"), None),
        "kv_cache_tokens_extraction": next((r["kv_cache_tokens"] for r in runs if r["config"] != "plain"), None),
    }
    s["by_spool_layout"] = by_layout = layouts(runs)
    f, ar = by_layout.get("files", {}), by_layout.get("arena", {})
    s["arena_vs_files_p50"] = _ratio(ar, f, "latency_p50_ms")
    s["arena_vs_files_p99"] = _ratio(ar, f, "latency_p99_ms")
    s["arena_vs_files_all_p99"] = _ratio(ar, f, "latency_all_p99_ms")
    s["by_fp8_encoding"] = by_fp8 = fp8_encoding(runs)
    dv, hv = by_fp8.get("device", {}), by_fp8.get("host", {})
    s["fp8_device_vs_host_p50"] = _ratio(dv, hv, "latency_p50_ms")
    doc["summary"] = s
    rows = [
        ("(a) plain vLLM prefill", f"{s['plain_tok_per_s']} tok/s", "1.000"),
        ("(b) delivered onto the trainer GPU", f"{s['stream_delivered_tok_per_s']} tok/s", s["stream_ratio_to_plain"]),
        ("(b) vLLM with our connector", "", s["stream_vllm_ratio_to_plain"]),
        ("(b) notice -> trainer GPU, steady-state window", f"p50 {s['latency_p50_ms']} ms, p99 {s['latency_p99_ms']} ms",
         f"floor {s['floor_ms']} ms"),
        ("(b) notice -> trainer GPU, every sample", f"p50 {s['latency_all_p50_ms']} ms, p99 {s['latency_all_p99_ms']} ms, "
         f"max {s['latency_all_max_ms']} ms", ""),
        *[row for lay, v in by_layout.items() for row in (
            (f"(b) spool layout {lay}: notice -> trainer GPU, steady-state window",
             f"p50 {v['latency_p50_ms']} ms, p99 {v['latency_p99_ms']} ms",
             f"vLLM {v['vllm_ratio_to_plain']} of plain, delivered {v['ratio_to_plain']}"),
            (f"(b) spool layout {lay}: notice -> trainer GPU, every sample",
             f"p50 {v['latency_all_p50_ms']} ms, p99 {v['latency_all_p99_ms']} ms, max {v['latency_all_max_ms']} ms",
             f"each job's first {FIRST}: p99 {v['first_p99_ms']} ms (max over runs {v['first_p99_ms_max']})"))],
        *[(f"(b) FP8 encoded on the {w}: notice -> trainer GPU", f"p50 {v['latency_p50_ms']} ms, p99 {v['latency_p99_ms']} ms",
           f"vLLM {v['vllm_ratio_to_plain']} of plain, delivered {v['ratio_to_plain']}") for w, v in by_fp8.items()],
        *[(f"(b) {lay}: {k}", f"p50 {v['breakdown'][k]['p50_ms']} ms, p99 {v['breakdown'][k]['p99_ms']} ms", "")
          for lay, v in by_layout.items() for k in STAGES if k in v["breakdown"]],
        ("(b) arena ÷ files latency", f"p50 {s['arena_vs_files_p50']}, p99 {s['arena_vs_files_p99']} (window)",
         f"p99 over every sample {s['arena_vs_files_all_p99']}"),
        ("(b) the same, yielded in delivery order", f"p50 {s['ordered_latency_p50_ms']} ms, "
         f"p99 {s['ordered_latency_p99_ms']} ms", "stream_ordered"),
        ("(c) Eagle-3 trainer", f"{s['train_samples_per_s']} samples/s, {s['train_tokens_per_s']} tok/s",
         f"waits {s['train_wait_frac']}"),
        ("(c) vLLM meanwhile", "", s["train_vllm_ratio_to_plain"]),
        ("(c) bound by", str(s["train_bound_by"]), f"trainer on {s['train_device_used']}"),
        ("peak spool / budget", f"{s['peak_spool_bytes']} B", f"{s['spool_budget_bytes']} B"),
        ("KV cache tokens plain / extraction", f"{s['kv_cache_tokens_plain']}", f"{s['kv_cache_tokens_extraction']}"),
    ]  # fmt: skip
    print("\n| measure | value | ÷ plain / note |\n|---|---|---|")
    for a, b, c in rows:
        print(f"| {a} | {b} | {c} |")
    print(flush=True)


#: The breakdown's stages the table shows per layout (all of them are in the JSON): the
#: connector's (``Notice.timings``), the sidecar's hop, and the trainer's read and checks.
#: (``connector_checksum`` includes the writer's host encoding when the payload is FP8 encoded
#: there; ``connector_copy_wait``: the writer waiting for the device-to-host copy's event.)
STAGES = ("forward_end_to_gpu", "connector_gather", "connector_queue", "connector_copy_wait", "connector_checksum",
          "connector_write",
          "sidecar", "sidecar_in", "sidecar_queue", "sidecar_to_trainer", "pool_queue", "check", "check_read",
          "check_checksum", "check_finite", "check_to_device", "copy_to_trainer_gpu")


def layouts(runs: list[dict]) -> dict[str, dict]:
    """Per spool layout, over its ``stream``/``stream_arena`` runs (means over rounds): the
    notice -> trainer GPU latency, the stream's and vLLM's rates ÷ plain, and each stage of the
    breakdown (mean of the runs' p50 and p99, ms)."""
    out: dict[str, dict] = {}
    for lay in ("files", "arena"):
        rs = [r for r in runs if r["config"] in ("stream", "stream_arena") and r.get("spool_layout", "files") == lay]
        if rs:
            out[lay] = _stream_group(rs)
    return out


def _ratio(a: dict, b: dict, key: str) -> float | None:
    """a[key] / b[key], rounded; None unless both groups have the figure."""
    return round(a[key] / b[key], 4) if a.get(key) and b.get(key) else None


def fp8_encoding(runs: list[dict]) -> dict[str, dict]:
    """With an FP8 payload, per place of the encoding (``host``: the writer threads, after the
    copy; ``device``: before it, the ``stream_fp8_device`` runs), the same as :func:`layouts`."""
    out: dict[str, dict] = {}
    fp8 = [r for r in runs if r.get("payload_dtype") == "fp8_e4m3" and r.get("spool_layout", "files") == "files"]
    for where, on_device in (("host", False), ("device", True)):
        rs = [r for r in fp8 if r["config"] in ("stream", "stream_fp8_device")
              and bool(r.get("fp8_on_device", r["config"] == "stream_fp8_device")) == on_device]
        if rs:
            out[where] = _stream_group(rs)
    return out


def _stream_group(rs: list[dict]) -> dict:
    """Means over (b) runs of one kind: latency, rates ÷ plain, each stage's p50 and p99."""

    def mean(get):  # noqa: ANN001, ANN202
        xs = [x for x in (get(r) for r in rs) if x is not None]
        return round(statistics.mean(xs), 4) if xs else None

    stages = sorted({k for r in rs for k, v in (r.get("breakdown") or {}).items() if isinstance(v, dict)})
    return {
        "configs": sorted({r["config"] for r in rs}), "runs": len(rs),
        # over the steady-state window; over every sample ("all"); each job's first samples
        "latency_p50_ms": mean(lambda r: r["latency_notice_to_gpu_ms"]["p50"]),
        "latency_p99_ms": mean(lambda r: r["latency_notice_to_gpu_ms"]["p99"]),
        "latency_all_p50_ms": mean(lambda r: _all(r, "p50")),
        "latency_all_p99_ms": mean(lambda r: _all(r, "p99")),
        "latency_all_max_ms": max((x for x in (_all(r, "max") for r in rs) if x is not None), default=None),
        "first_p99_ms": mean(lambda r: _first(r, "p99")),
        "first_p99_ms_max": max((x for x in (_first(r, "p99") for r in rs) if x is not None), default=None),
        "delivered_tok_per_s": mean(lambda r: r["delivered_to_trainer_gpu"].get("tok_per_s")),
        "ratio_to_plain": mean(lambda r: r.get("ratio_to_plain")),
        "vllm_ratio_to_plain": mean(lambda r: r.get("vllm_ratio_to_plain")),
        "breakdown": {k: {q: mean(lambda r, k=k, q=q: ((r.get("breakdown") or {}).get(k) or {}).get(q))
                          for q in ("p50_ms", "p99_ms")} for k in stages},
    }  # fmt: skip


def _all(r: dict, q: str) -> float | None:
    """A run's notice -> GPU figure ``q`` over every delivered sample (None in older files)."""
    return (r["latency_notice_to_gpu_ms"].get("all") or {}).get(q)


def _first(r: dict, q: str) -> float | None:
    """A run's notice -> GPU figure ``q`` over its job's first :data:`FIRST` samples (None in older files)."""
    return (r["latency_notice_to_gpu_ms"].get(f"first_{FIRST}") or {}).get(q)


def _gpu_names() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().replace("\n", ", ") or "cpu"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "cpu"
