#!/usr/bin/env python3
"""Samples/s of the trainer-side checks of one sample, old vs new, side by side in one run.

One 1,024-token sample at Qwen3-8B shape (4 layers x 4096 hidden, bf16: 32 KiB/token,
33.5 MB) is written to a temporary spool on /dev/shm the way the connector writes it, then read
and validated repeatedly, the variants interleaved round by round so all see the same machine:

* ``old``: the stream before issue 9 — safetensors ``safe_open`` copy, blake3 on one thread,
  ``torch.isfinite`` (kept here verbatim as the reference);
* ``new blake3`` / ``new xxh3-128``: ``trainer_client.stream.load_and_check`` as the stream runs
  it — one read into one buffer, the checksum the notice names (blake3 on all cores, or xxh3),
  the exponent-bit finiteness test.

Every variant validates the same file (the check verdicts are asserted); per-phase times
(read, checksum, finiteness) come from separate timings of each phase.

    python bench/validate_throughput.py            # writes bench/results/validate_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from connector import protocol as P  # noqa: E402
from trainer_client import stream as S  # noqa: E402


def write_sample(spool: Path, algo: str, tokens: int, layers: int, hidden: int) -> P.Deliver:
    g = torch.Generator().manual_seed(0)
    hs = (torch.randn(tokens, layers, hidden, generator=g) * 2).to(torch.bfloat16)
    ids = torch.randint(0, 151_000, (tokens,), generator=g)
    name = f"bench-{algo}.safetensors"
    notice = P.Notice(
        status=P.NoticeStatus.ok, request_id="bench", key=P.SampleKey(job="bench", index=0), file=name,
        num_tokens=tokens, layer_ids=list(range(layers)), num_hidden_layers=layers, hidden_size=hidden,
        dtype="bfloat16", nbytes=hs.numel() * 2, model="bench",
        checksum=P.checksum(hs.view(torch.uint8).numpy(), ids.numpy(), algo=algo), checksum_algo=algo,
    )  # fmt: skip
    save_file({P.HIDDEN_STATES_KEY: hs, P.TOKEN_IDS_KEY: ids}, str(spool / name), metadata=P.header_metadata(notice))
    return P.Deliver(notice=notice, expected_token_ids=ids.tolist())


def old_check(spool: Path, d: P.Deliver) -> dict:
    """The stream's checks as they were (commit e6ea092), for comparison."""
    n = d.notice
    with safe_open(str(P.resolve_in_spool(spool, n.file)), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    hs, ids = tensors[P.HIDDEN_STATES_KEY], tensors[P.TOKEN_IDS_KEY]
    assert tuple(hs.shape) == (n.num_tokens, len(n.layer_ids), n.hidden_size)
    assert P.checksum(hs.contiguous().view(torch.uint8).numpy(), ids.numpy(), algo="blake3", threads=1) == n.checksum
    assert bool(torch.isfinite(hs).all())
    assert ids.tolist() == d.expected_token_ids
    return tensors


def timed(fn, *a, **kw) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn(*a, **kw)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--spool-root", default="/dev/shm")
    ap.add_argument("--out", default=str(ROOT / "bench/results/validate_throughput_cpu.json"))
    a = ap.parse_args()

    spool = Path(tempfile.mkdtemp(prefix="hsstream-bench-validate-", dir=a.spool_root))
    try:
        d_b3 = write_sample(spool, "blake3", a.tokens, a.layers, a.hidden)
        d_xx = write_sample(spool, "xxh3-128", a.tokens, a.layers, a.hidden)
        variants = {
            "old (safe_open, blake3 1 thread, torch.isfinite)": lambda: old_check(spool, d_b3),
            "new, blake3 (all cores)": lambda: S.load_and_check(spool, d_b3),
            "new, xxh3-128": lambda: S.load_and_check(spool, d_xx),
        }
        for fn in variants.values():  # warm-up; also proves every variant accepts the sample
            fn()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.rounds):
            for k, fn in variants.items():
                times[k].append(timed(fn))

        # phases, on the tensors the new reader produced
        smp = S.load_and_check(spool, d_b3)
        hs8, ids = smp.hidden_states.view(torch.uint8).numpy(), smp.token_ids.numpy()
        path = P.resolve_in_spool(spool, d_b3.notice.file)
        buf = torch.empty(path.stat().st_size, dtype=torch.uint8)  # as torch's pinned allocator hands back

        def reuse(n: int) -> torch.Tensor:
            return buf[:n]

        phases = {
            "read: safe_open (mmap, no copy; old and new unpinned)": lambda: old_read(path),
            "read: one readinto a reused buffer (new, pinned path)": lambda: S.read_into_buffer(path, None, reuse),
            "checksum blake3, 1 thread (old)": lambda: P.checksum(hs8, ids, algo="blake3", threads=1),
            "checksum blake3, all cores (new)": lambda: P.checksum(hs8, ids, algo="blake3", threads=0),
            "checksum xxh3-128 (new)": lambda: P.checksum(hs8, ids, algo="xxh3-128"),
            "finite: torch.isfinite (old)": lambda: bool(torch.isfinite(smp.hidden_states).all()),
            "finite: exponent bits (new)": lambda: S.all_finite(smp.hidden_states),
        }
        ptimes = {k: statistics.median(timed(fn) for _ in range(max(3, a.rounds // 2))) for k, fn in phases.items()}
    finally:
        shutil.rmtree(spool, ignore_errors=True)

    mb = a.tokens * a.layers * a.hidden * 2 / 1e6
    rows = []
    print(f"validation of one {a.tokens}-token sample ({a.layers} layers x {a.hidden}, bf16, {mb:.1f} MB), "
          f"{os.cpu_count()} CPUs, median of {a.rounds} interleaved rounds")  # fmt: skip
    print(f"{'variant':52s} {'ms/sample':>10s} {'samples/s':>10s}")
    for k, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": k, "ms_per_sample_p50": round(med * 1e3, 2), "samples_per_s": round(1 / med, 1),
                     "ms_all": [round(t * 1e3, 2) for t in ts]})  # fmt: skip
        print(f"{k:52s} {med * 1e3:10.1f} {1 / med:10.1f}")
    print(f"\n{'phase':52s} {'ms':>10s}")
    for k, t in ptimes.items():
        print(f"{k:52s} {t * 1e3:10.2f}")
    res = {
        "what": "trainer-side validation of one sample (read, shape/dtype, checksum, finiteness, token ids)",
        "command": "python bench/validate_throughput.py " + " ".join(sys.argv[1:]),
        "shape": {"tokens": a.tokens, "layers": a.layers, "hidden": a.hidden, "dtype": "bfloat16", "mb": round(mb, 1)},
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
                 "note": "shared 2-core machine; GPU-host figures come from bench/online_gpu.py"},  # fmt: skip
        "rounds": a.rounds,
        "variants": rows,
        "phases_ms_p50": {k: round(t * 1e3, 2) for k, t in ptimes.items()},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    return 0


def old_read(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


if __name__ == "__main__":
    sys.exit(main())
