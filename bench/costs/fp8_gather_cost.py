#!/usr/bin/env python3
"""Where FP8 quantisation should happen in the connector: on the host after a bf16 copy, or on
the GPU before an FP8 copy (issue 27). No vLLM: the connector's gatherer on a fake cache.

With ``HSSTREAM_PAYLOAD_DTYPE=fp8_e4m3`` the connector's ``HiddenStateGatherer`` can either
copy the bf16 rows device-to-host into pinned memory and let the writer thread quantise them on
the host (``encode_at_gather=False``), or quantise each chunk on its side stream and copy the
FP8 values and per-token scales (``encode_at_gather=True``: about half the bytes over PCIe, no
host quantise on a CPU vLLM shares). This times both on one request at a time, on a fake
hidden-state cache of the dummy draft at Qwen3-8B shape (4 layers x 4096 hidden, bf16,
1,024-token requests, vLLM 0.30+'s logical ``[blocks, K, block_size, H]`` view of a
token-major cache, the request's blocks scattered over the cache):

* ``host``: the gatherer's ``copy_async`` (bf16 D2H into pinned memory, on its side stream),
  the copy's event, then the writer's host quantise (``SpoolWriter.encode``, i.e.
  the FP8 codec's ``encode`` (``HSSTREAM_PAYLOAD_DTYPE=fp8_e4m3``) on the host tensor, counted as the writer counts it);
* ``device``: the gatherer's ``copy_async`` with the quantise on the side stream, FP8 D2H,
  the copy's event.

A real ``HiddenStateGatherer`` and a real ``SpoolWriter`` (``notice_endpoint=None``, spool in a
temp dir) are driven through ``copy_async`` and ``encode``, the calls ``submit`` and the
writer thread make, without the file write and checksum that follow either way (the same for
both arms). Arms are interleaved, their order alternated each round, after a warm-up. Per arm:
submit -> encoded host tensors ready (p50 / p99 ms), and bytes copied device-to-host (the
writer's ``bytes_copied`` count over the copy). Each round, both arms' FP8 values and scales
are compared byte for byte (``torch.equal`` on uint8 views): ``bytes_equal`` in the JSON is
that comparison's result over all rounds, not an assumption.

    python bench/costs/fp8_gather_cost.py                  # GPU: bench/results/fp8_gather_h200.json
    python bench/costs/fp8_gather_cost.py --cpu-smoke      # CPU tensors, same code, no timing claims
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.common import pctl as pct  # noqa: E402

ARMS = ("host", "device")




def fake_cache(num_blocks: int, block_size: int, layers: int, hidden: int, device, seed: int = 0):  # noqa: ANN001, ANN201
    """A token-major cache ``[blocks, block_size, K, H]`` in bf16, handed over as vLLM 0.30+
    does, as its logical ``[blocks, K, block_size, H]`` view (``cache_layout`` detects it);
    values like hidden states: unit normal, per-token magnitudes spread, a few outliers."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    kv = torch.empty((num_blocks, block_size, layers, hidden), dtype=torch.bfloat16, device=device)
    for b in range(0, num_blocks, 256):  # in pieces: no fp32 copy of the whole cache on the host
        e = min(num_blocks, b + 256)
        x = torch.randn((e - b, block_size, layers, hidden), generator=g)
        x *= torch.rand((e - b, block_size, layers, 1), generator=g) * 8 + 0.1
        x[..., :4] *= 50  # outlier channels, as real hidden states have
        kv[b:e] = x.to(torch.bfloat16).to(device)
    return kv.permute(0, 2, 1, 3)


def make_gatherer(kv, block_size: int, layers: int, hidden: int, spool: Path, encode_at_gather: bool):  # noqa: ANN001, ANN201
    from connector.contract import payload as PL
    from connector.spool_writer import ShapeInfo, SpoolWriter
    from connector.worker_side import HiddenStateGatherer

    shape = ShapeInfo(layer_ids=list(range(1, layers + 1)), num_hidden_layers=layers, hidden_size=hidden,
                      dtype=PL.stored_dtype("fp8_e4m3", "bfloat16"), model="fake")  # fmt: skip
    w = SpoolWriter(spool, None, shape, num_threads=1)
    g = HiddenStateGatherer(kv, block_size, layers, None, w, encode_at_gather=encode_at_gather)
    if g.encode_at_gather != encode_at_gather:
        raise RuntimeError(f"the gatherer refused encode_at_gather={encode_at_gather}")
    return g, w


def one(arm: str, g, w, blocks: list[int], n: int, cuda: bool) -> tuple[float, dict, int, float]:  # noqa: ANN001
    """One request through ``arm``: (seconds submit -> encoded host tensors, the tensors, D2H
    bytes, seconds submit -> copy landed)."""
    from connector.contract.sample_file import HIDDEN_STATES_KEY

    b0 = w.stats["bytes_copied"]
    t0 = time.perf_counter()
    g.step_starts()
    if cuda:
        host, event = g.copy_async(blocks, n)
        event.synchronize()
    else:  # the same chunked gather (and on-device encode), run synchronously on CPU tensors
        host = g.empty_host(n, pin_memory=False)
        g.gather_into(blocks, n, host)
    moved = w.stats["bytes_copied"] - b0
    t1 = time.perf_counter()
    enc = host if g.encode_at_gather else w.encode(host[HIDDEN_STATES_KEY])
    dt = time.perf_counter() - t0
    return dt, enc, moved, t1 - t0


def same_bytes(a: dict, b: dict) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
                                    for k in a)  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    import random

    import torch

    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --cpu-smoke")
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    per_req = -(-args.tokens // args.block_size)
    kv = fake_cache(args.num_blocks, args.block_size, args.layers, args.hidden, dev)
    rng = random.Random(1)
    spool = Path(tempfile.mkdtemp(prefix="hsstream-fp8-gather-"))
    gs = {arm: make_gatherer(kv, args.block_size, args.layers, args.hidden, spool, arm == "device") for arm in ARMS}
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    moved: dict[str, list[int]] = {a: [] for a in ARMS}
    landed: dict[str, list[float]] = {a: [] for a in ARMS}
    equal_rounds = 0
    try:
        for r in range(args.warmup + args.rounds):
            blocks = rng.sample(range(args.num_blocks), per_req)  # scattered, as a busy cache's
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            enc = {}
            for arm in order:
                g, w = gs[arm]
                dt, enc[arm], b, t_copy = one(arm, g, w, blocks, args.tokens, cuda)
                if r >= args.warmup:
                    times[arm].append(dt)
                    moved[arm].append(b)
                    landed[arm].append(t_copy)
            if r >= args.warmup:
                equal_rounds += same_bytes(enc["host"], enc["device"])
    finally:
        for _, w in gs.values():
            w.close()
        import shutil

        shutil.rmtree(spool, ignore_errors=True)
    bf16_bytes = args.tokens * args.layers * args.hidden * 2
    arms = {a: {"p50_ms": round(1000 * statistics.median(times[a]), 3), "p99_ms": round(1000 * pct(times[a], 0.99), 3),
                "mean_ms": round(1000 * statistics.mean(times[a]), 3), "n": len(times[a]),
                "copy_landed_p50_ms": round(1000 * statistics.median(landed[a]), 3),
                "host_encode_p50_ms": round(1000 * statistics.median(x - y for x, y in zip(times[a], landed[a])), 3),
                "d2h_bytes": moved[a][0] if len(set(moved[a])) == 1 else moved[a],
                "encode_at_gather": a == "device"} for a in ARMS}  # fmt: skip
    out = {
        "benchmark": "fp8_gather_cost", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(["python bench/costs/fp8_gather_cost.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu (smoke: no timing claims)",
        "torch": torch.__version__,
        "shape": {"tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "dtype": "bfloat16",
                  "block_size": args.block_size, "num_blocks": args.num_blocks,
                  "cache_view": "[blocks, K, block_size, H] of a token-major cache (vLLM 0.30+)",
                  "bf16_bytes_per_request": bf16_bytes},
        "driven": "real HiddenStateGatherer + SpoolWriter(notice_endpoint=None): copy_async (CUDA) or "
                  "empty_host + gather_into (CPU smoke), then SpoolWriter.encode for the host arm",
        "timed": "submit -> encoded host tensors ready (copy event synchronised; host arm: plus the host quantise)",
        "warmup": args.warmup, "rounds": args.rounds, "interleaved": "order alternated each round",
        "arms": arms,
        "device_vs_host_p50": round(arms["device"]["p50_ms"] / arms["host"]["p50_ms"], 4) if arms["host"]["p50_ms"] else None,
        "bytes_equal": equal_rounds == args.rounds, "bytes_equal_rounds": equal_rounds,
        "torch_threads": torch.get_num_threads(),  # the host quantise's intra-op threads (vLLM's writer: its own)
    }  # fmt: skip
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=4096, help="cache blocks (4096 x 16 tokens: 2 GiB at this shape)")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU tensors, small shape, few rounds (tests the code)")
    ap.add_argument("--out", default=None, help="default bench/results/fp8_gather_h200.json (GPU), none (smoke)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        for k, v in (("tokens", 100), ("hidden", 256), ("num_blocks", 64), ("rounds", 4), ("warmup", 1)):
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    res = run(args)
    print(json.dumps({k: res[k] for k in ("device", "arms", "device_vs_host_p50", "bytes_equal")}, indent=1))
    out = args.out or (None if args.cpu_smoke else str(ROOT / "bench" / "results" / "fp8_gather_h200.json"))
    for p in [out] + ([os.path.join(os.environ["OUT"], Path(out).name)] if out and os.environ.get("OUT") else []):
        if p:
            Path(p).parent.mkdir(parents=True, exist_ok=True)
            Path(p).write_text(json.dumps(res, indent=1))
            print(f"wrote {p}")
    return 0 if res["bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
