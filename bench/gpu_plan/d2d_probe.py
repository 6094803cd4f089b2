#!/usr/bin/env python3
"""Device to device on one GPU, before building it (issue 44, 4): what a device-resident slot
costs when vLLM's process gathers a sample into it and the trainer's process reads it through
CUDA IPC, the bytes never on the host.

Two processes on one GPU, as vLLM and a trainer sharing it:

* the **producer** (vLLM's worker side) holds a "KV cache" of ``--blocks`` blocks and a ring of
  ``--slots`` device slots (one sample each, Qwen3-8B's shape: ``--tokens`` x 4 layers x 4096,
  bf16), shared once with the consumer (torch.multiprocessing: CUDA IPC handles); per sample it
  gathers a request's scattered blocks into a free slot on a side stream, records an
  interprocess event after it, and sends the notice (slot, event, ``sent_at``);
* the **consumer** (the trainer) waits on that event on its own stream, checks the sample's
  finiteness there (``torch.isfinite(...).all()``, as ``--finite-on-device`` does), syncs, and
  gives the slot back; its latency is notice -> tensor usable on the GPU (one host clock).

Reported: that latency over every sample and over the steady-state window (10-90 % of completion
times), p50 / p99 / max, and the producer's gather p50 (forward end -> notice); the bytes equal in
every ``--verify-every`` th sample (a host copy of the slot against the gather's source). What it
leaves out: the lease/claim a real slot needs across a crash, and vLLM's own load on the GPU.

    python bench/gpu_plan/d2d_probe.py                     # GPU: writes bench/results/d2d_probe_h200.json
    python bench/gpu_plan/d2d_probe.py --cpu-smoke         # the same protocol on CPU shared memory
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.common import pctl, window_bounds  # noqa: E402
WINDOW = (0.10, 0.90)


def pct(xs: list[float], q: float) -> float | None:
    v = pctl(xs, q)
    return None if v is None else round(v, 3)


def three(xs: list[float]) -> dict:
    return {"p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99), "max_ms": round(max(xs), 3) if xs else None, "n": len(xs)}


def summarize(lat_ms: list[float], done_at: list[float]) -> dict:
    """Every sample, and the steady-state window of completion times, each named."""
    lo, hi = window_bounds(done_at, *WINDOW)
    return {"all": three(lat_ms), "window": three([v for v, t in zip(lat_ms, done_at, strict=True) if lo <= t <= hi]),
            "first_32": three(lat_ms[:32])}  # fmt: skip


def producer(a: argparse.Namespace, slots, to_cons, from_cons, dev: str) -> None:  # noqa: ANN001
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    blocks = -(-a.tokens // a.block_size)
    cache = (torch.randn((a.blocks, a.block_size, a.layers, a.hidden), generator=g) * 0.5).to(torch.bfloat16).to(dev)
    cuda = dev.startswith("cuda")
    side = torch.cuda.Stream() if cuda else None
    free = list(range(len(slots)))
    gathers = []
    for i in range(a.samples + a.warmup):
        while not free:
            free.append(from_cons.get())
        k = free.pop(0)
        ids = torch.randperm(a.blocks, generator=g)[:blocks].to(dev)
        t0 = time.perf_counter()
        if cuda:
            ev = torch.cuda.Event(interprocess=True)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                slots[k].copy_(cache.index_select(0, ids).reshape(-1, a.layers, a.hidden)[: a.tokens])
                ev.record(side)
            handle = ev.ipc_handle()
        else:
            slots[k].copy_(cache.index_select(0, ids).reshape(-1, a.layers, a.hidden)[: a.tokens])
            handle = None
        gathers.append(time.perf_counter() - t0)
        want = None
        if a.verify_every and i % a.verify_every == 0:
            want = cache.index_select(0, ids).reshape(-1, a.layers, a.hidden)[: a.tokens].float().sum().item()
        to_cons.put({"i": i, "slot": k, "event": handle, "sent_at": time.time(), "sum": want})
        if a.pace_ms:
            time.sleep(a.pace_ms / 1000)
    to_cons.put(None)
    to_cons.put({"gather_ms": [1000 * x for x in gathers[a.warmup :]]})


def consumer(a: argparse.Namespace, slots, to_cons, from_cons, dev: str, out) -> None:  # noqa: ANN001
    import torch

    cuda = dev.startswith("cuda")
    lat, done, bad, checked = [], [], 0, 0
    while (n := to_cons.get()) is not None:
        x = slots[n["slot"]]
        if cuda:
            torch.cuda.current_stream().wait_event(torch.cuda.Event.from_ipc_handle(torch.device(dev), n["event"]))
        ok = bool(torch.isfinite(x).all())  # syncs: the sample is usable on the device now
        t = time.time()
        if n["sum"] is not None:
            checked += 1
            bad += abs(x.float().sum().item() - n["sum"]) > 1e-3 * max(1.0, abs(n["sum"]))
        bad += not ok
        from_cons.put(n["slot"])
        if n["i"] >= a.warmup:
            lat.append(1000 * (t - n["sent_at"]))
            done.append(t)
    out.put({"lat_ms": lat, "done_at": done, "bad": bad, "checked": checked, **to_cons.get()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--slots", type=int, default=16, help="device slots in the ring (the arena's budget, in samples)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pace-ms", type=float, default=0.0, help="pause between samples (0: back to back)")
    ap.add_argument("--verify-every", type=int, default=16)
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU shared memory, small shape: the protocol only")
    ap.add_argument("--out", default=None, help="default bench/results/d2d_probe_h200.json (GPU), none (smoke)")
    a = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    if a.cpu_smoke:
        a.samples, a.warmup, a.tokens, a.hidden, a.blocks, a.slots = min(a.samples, 64), 4, 64, 128, 64, 4
        dev = "cpu"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --cpu-smoke")
        dev = "cuda:0"
    ctx = mp.get_context("spawn")
    slots = [torch.empty((a.tokens, a.layers, a.hidden), dtype=torch.bfloat16, device=dev) for _ in range(a.slots)]
    if not a.cpu_smoke:
        torch.cuda.synchronize()
    else:
        for s in slots:
            s.share_memory_()
    to_cons, from_cons, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    cons = ctx.Process(target=consumer, args=(a, slots, to_cons, from_cons, dev, out))
    cons.start()
    t0 = time.time()
    producer(a, slots, to_cons, from_cons, dev)
    r = out.get(timeout=600)
    cons.join(60)
    res = {"benchmark": "d2d_probe", "device": torch.cuda.get_device_name(0) if not a.cpu_smoke else "cpu",
           "args": vars(a), "wall_s": round(time.time() - t0, 2),
           "notice_to_device_tensor": summarize(r["lat_ms"], r["done_at"]),
           "gather_ms": three(r["gather_ms"]), "bytes_checked": r["checked"], "bad": r["bad"],
           "ok": r["bad"] == 0 and r["checked"] > 0 and len(r["lat_ms"]) == a.samples}  # fmt: skip
    print(json.dumps({k: res[k] for k in ("notice_to_device_tensor", "gather_ms", "bytes_checked", "bad", "ok")}, indent=1))
    out_path = a.out or (None if a.cpu_smoke else str(ROOT / "bench/results/d2d_probe_h200.json"))
    for d in ([Path(out_path)] if out_path else []) + ([Path(os.environ["OUT"]) / "d2d_probe_h200.json"]
                                                        if os.environ.get("OUT") and not a.cpu_smoke else []):  # fmt: skip
        d.parent.mkdir(parents=True, exist_ok=True)
        d.write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
