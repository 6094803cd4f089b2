#!/usr/bin/env python3
"""What the connector's per-sample checksum costs, by algorithm and thread count (issue 26).

The connector's writer threads (``connector/spool_writer.py``, inside vLLM's worker process)
compute one checksum per sample before writing its file: the notice names the kind, the reader
verifies it. At Qwen3-8B shape (1,024 tokens x 4 layers x 4096 hidden, bf16: 33.5 MB) blake3 on
one thread took ~8 ms per sample on the H200 host, every sample, on a CPU that vLLM's engine
shares. This measures the choices, on a sample built as the writer builds it (the payload
codec's tensors plus int64 token ids, through ``sample_file.sample_checksum``, the writer's call):

* blake3 on 1 thread (the writer before issue 26), on 2 and 4 threads where the host has the
  cores, and on all of them (``threads=0``: blake3's AUTO);
* xxh3-128 (one thread: xxhash has no threads).

Two settings, arms interleaved round by round (the order rotated each round) so all see the
same machine:

* ``alone``: one checksum at a time: the latency a sample's checksum adds;
* ``burst``: ``--writers`` samples hashed at once, one per thread, as the connector's writer
  pool (``HSSTREAM_NUM_WRITER_THREADS``, 4) does when a prefill step finishes a batch of
  samples together: whether threads inside one checksum still pay when the writers already
  run side by side.

Per arm: wall time per sample (p50 / p99), GB/s at the p50, and CPU time per sample (the
process's CPU seconds over the call, all threads): what the engine's CPU loses, which more
threads never lower. Every arm's digest is checked against its reference (threads never change
blake3's digest).

    python bench/costs/checksum_cost.py                 # writes bench/results/checksum_cpu.json
    python bench/costs/checksum_cost.py --out bench/results/checksum_h200.json   # on the GPU host
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import blake3  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from bench.common import cpu_model  # noqa: E402
from bench.common import pctl  # noqa: E402
from connector.contract import payload as PL, sample_file as SF  # noqa: E402


def make_sample(tokens: int, layers: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """A sample's tensors as the writer builds them: the payload codec's encoding of bf16
    hidden states, and int64 token ids."""
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(tokens, layers, hidden, generator=g) * 2).to(torch.bfloat16)
    ids = torch.randint(0, 151_000, (tokens,), generator=g, dtype=torch.int64)
    return {**PL.codec("bfloat16").encode(hs), SF.TOKEN_IDS_KEY: ids}


def arms(cpus: int) -> dict[str, tuple[str, int]]:
    """name -> (algo, threads)."""
    out = {"blake3, 1 thread": ("blake3", 1)}
    for t in (2, 4):
        if t <= cpus:
            out[f"blake3, {t} threads"] = ("blake3", t)
    out[f"blake3, all threads (AUTO, {cpus} cpus)"] = ("blake3", 0)
    out["xxh3-128, 1 thread"] = ("xxh3-128", 1)
    return out


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def burst(samples: list[dict[str, torch.Tensor]], algo: str, threads: int) -> list[float]:
    """Each sample hashed on its own thread, all started together (a barrier): per-sample wall
    seconds. The checksum libraries release the GIL, as the writers rely on."""
    walls = [0.0] * len(samples)
    go = threading.Barrier(len(samples))

    def one(i: int) -> None:
        go.wait()
        t0 = time.perf_counter()
        SF.sample_checksum(samples[i], algo=algo, threads=threads)
        walls[i] = time.perf_counter() - t0

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(samples))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return walls




def summary(walls: list[float], cpus_s: list[float], nbytes: int) -> dict:
    p50 = pctl(walls, 0.5)
    return {"ms_p50": round(p50 * 1e3, 3), "ms_p99": round(pctl(walls, 0.99) * 1e3, 3),
            "gb_per_s_p50": round(nbytes / p50 / 1e9, 2), "n": len(walls),
            **({"cpu_ms_per_sample_p50": round(statistics.median(cpus_s) * 1e3, 3)} if cpus_s else {}),
            "ms_all": [round(w * 1e3, 3) for w in walls]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (at least 7)")
    ap.add_argument("--writers", type=int, default=4, help="samples hashed at once in the burst setting (0: skip)")
    ap.add_argument("--note", default="", help="what else ran on the host")
    ap.add_argument("--out", default=str(ROOT / "bench/results/checksum_cpu.json"))
    a = ap.parse_args(argv)
    if a.rounds < 7:
        ap.error("--rounds must be at least 7")

    cpus = os.cpu_count() or 1
    load0 = os.getloadavg()
    samples = [make_sample(a.tokens, a.layers, a.hidden, seed) for seed in range(max(1, a.writers))]
    nbytes = sum(int(memoryview(b).nbytes) for b in SF.checksum_buffers(samples[0]))
    arm = arms(cpus)
    # References: the libraries' one-shot digests of the concatenated bytes (the writer's
    # digest must be these, whatever the thread count).
    whole = b"".join(bytes(memoryview(b).cast("B")) for b in SF.checksum_buffers(samples[0]))
    ref = {"blake3": blake3.blake3(whole).hexdigest(), "xxh3-128": xxhash.xxh3_128_hexdigest(whole)}
    del whole
    for name, (algo, threads) in arm.items():  # warm-up; also proves each arm's digest
        got = SF.sample_checksum(samples[0], algo=algo, threads=threads)
        assert got == ref[algo], f"{name}: digest {got} != reference {ref[algo]}"

    alone: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in arm}
    bursts: dict[str, list[float]] = {k: [] for k in arm}
    names = list(arm)
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            algo, threads = arm[k]
            w, c = timed(lambda: SF.sample_checksum(samples[0], algo=algo, threads=threads))  # noqa: B023
            alone[k][0].append(w)
            alone[k][1].append(c)
        if a.writers > 1:
            for k in order:
                bursts[k] += burst(samples, *arm[k])
    load1 = os.getloadavg()

    mb = nbytes / 1e6
    print(f"checksum of one {a.tokens}-token sample ({a.layers} layers x {a.hidden}, bf16 + int64 ids, {mb:.1f} MB), "
          f"{cpus} CPUs, {a.rounds} interleaved rounds; load average {load0[0]:.2f} -> {load1[0]:.2f}")  # fmt: skip
    rows = []
    hdr = f"{'arm':40s} {'p50 ms':>8s} {'p99 ms':>8s} {'GB/s':>7s} {'CPU ms':>8s}"
    print("\nalone (one checksum at a time)\n" + hdr)
    for k, (ws, cs) in alone.items():
        s = summary(ws, cs, nbytes)
        rows.append({"arm": k, "algo": arm[k][0], "threads": arm[k][1], **s})
        cpu = s["cpu_ms_per_sample_p50"]
        print(f"{k:40s} {s['ms_p50']:8.2f} {s['ms_p99']:8.2f} {s['gb_per_s_p50']:7.2f} {cpu:8.2f}")
    brows = []
    if a.writers > 1:
        print(f"\nburst ({a.writers} samples at once, one per writer thread; per-sample wall)\n" + hdr[:-9])
        for k, ws in bursts.items():
            s = summary(ws, [], nbytes)
            brows.append({"arm": k, "algo": arm[k][0], "threads": arm[k][1], **s})
            print(f"{k:40s} {s['ms_p50']:8.2f} {s['ms_p99']:8.2f} {s['gb_per_s_p50']:7.2f}")
    res = {
        "what": "per-sample checksum of the connector's writer (sample_file.sample_checksum over the payload codec's "
                "tensors + int64 token ids), by algorithm and thread count",
        "command": "python bench/costs/checksum_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": {"tokens": a.tokens, "layers": a.layers, "hidden": a.hidden, "dtype": "bfloat16",
                  "bytes": nbytes, "mb": round(mb, 1)},
        "host": {"cpus": cpus, "cpu_model": cpu_model(), "machine": platform.machine(),
                 "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in load1],
                 "note": a.note},
        "versions": {"python": platform.python_version(), "blake3": blake3.__version__, "xxhash": xxhash.VERSION,
                     "libxxhash": xxhash.XXHASH_VERSION, "torch": torch.__version__},
        "rounds": a.rounds,
        "timing": "wall: perf_counter around one sample_checksum call; cpu: process_time over the same call (all "
                  "threads); arms interleaved, order rotated each round, after one warm-up call each",
        "alone": rows,
        "burst": {"writers": a.writers, "what": "the writers' samples hashed at once, one per thread (a barrier "
                  "starts them); per-sample wall", "arms": brows},
    }  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
