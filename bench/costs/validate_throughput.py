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

Then **bursts** (issue 9's latency): the connector's writer threads finish a prefill batch's
samples together (~16 at once on an H200), and the stream used to check them one after another.
A stand-in sidecar (a ZeroMQ ROUTER: the real ``HiddenStateStream``, real ipc://, real files on
/dev/shm, only the sidecar's ledger left out) sends ``--burst-size`` deliveries at once, stamped
``sent_at`` like the connector's notices, honouring the stream's credit; the next burst goes
when the last one's credit is back. Latency = notice stamp -> the sample handed to the loop,
p50/p99 per ``--workers`` setting (0: checked on the iterating thread, the stream before the
pool; 1: one worker; N: the pool), the settings interleaved burst by burst.

    python bench/costs/validate_throughput.py            # writes bench/results/validate_throughput_cpu.json
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.common import pctl  # noqa: E402

import torch  # noqa: E402
import zmq  # noqa: E402
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


class BurstSidecar:
    """Stand-in for the sidecar's delivery side: bursts of deliveries of hard links to one
    sample file (the stream unlinks each after reading; the original stays), within credit."""

    def __init__(self, spool: Path, d: P.Deliver, endpoint: str, burst: int) -> None:
        self.spool, self.d, self.burst = spool, d, burst
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.ident: bytes | None = None
        self.credit = 0
        self.index = 0

    def _pump(self, timeout_ms: int) -> None:
        if self.sock.poll(timeout_ms):
            frames = self.sock.recv_multipart()
            self.ident, msg = frames[0], P.decode_msg(frames[1:])
            if isinstance(msg, P.Credit):
                self.credit += msg.n

    def send_burst(self, deadline_s: float = 60.0) -> None:
        t_end = time.monotonic() + deadline_s
        while self.ident is None or self.credit < self.burst:  # the last burst drained
            if time.monotonic() > t_end:
                raise TimeoutError("the stream did not take the last burst")
            self._pump(20)
        src = P.resolve_in_spool(self.spool, self.d.notice.file)
        first = self.index
        for i in range(first, first + self.burst):
            os.link(src, self.spool / f"hs-burst-{i}.safetensors")
        for i in range(first, first + self.burst):  # stamped as the connector stamps a notice: when it is sent
            n = self.d.notice.model_copy(update={"file": f"hs-burst-{i}.safetensors", "sent_at": time.time(),
                                                 "key": P.SampleKey(job="bench", index=i)})  # fmt: skip
            self.sock.send_multipart([self.ident, *P.encode_msg(self.d.model_copy(update={"notice": n}))])
            self.credit -= 1
        self.index += self.burst

    def end(self) -> None:
        while self.credit < self.burst:
            self._pump(20)
        self.sock.send_multipart([self.ident, *P.encode_msg(P.End())])

    def close(self) -> None:
        self.sock.close(linger=0)


def burst_latency(spool: Path, d: P.Deliver, workers: int, bursts: int, burst: int, gap_s: float) -> list[dict]:
    """One stream (``workers``), ``bursts`` bursts of ``burst`` deliveries; per sample: latency
    notice -> handed to the loop, and where it went (waiting for a worker, checking, in order)."""
    ep = f"ipc://{spool}/burst-{workers}.sock"
    sc = BurstSidecar(spool, d, ep, burst)
    rows: list[dict] = []

    def feed() -> None:
        for _ in range(bursts):
            sc.send_burst()
            time.sleep(gap_s)
        sc.end()

    t = threading.Thread(target=feed, daemon=True)
    try:
        with S.HiddenStateStream(ep, spool_dir=spool, credit=burst, workers=workers, timeout_s=20) as st:
            t.start()
            for smp in st:
                tm = smp.timings
                sent = smp.notice.sent_at
                rows.append({"latency_ms": 1e3 * (tm["handed"] - sent), "queue_ms": 1e3 * (tm["started"] - tm["received"]),
                             "check_ms": 1e3 * (tm["checked"] - tm["started"]),
                             "in_order_ms": 1e3 * (tm["handed"] - tm["checked"]), "sent": sent, "handed": tm["handed"]})  # fmt: skip
        t.join(10)
    finally:
        sc.close()
    if len(rows) != bursts * burst:
        raise RuntimeError(f"workers={workers}: {len(rows)} samples of {bursts * burst}")
    return rows




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
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4], help="pool sizes for the bursts")
    ap.add_argument("--bursts", type=int, default=8, help="bursts per pool size (interleaved)")
    ap.add_argument("--burst-size", type=int, default=16)
    ap.add_argument("--burst-gap", type=float, default=0.1, help="seconds between a drained burst and the next")
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

        def fresh(n: int) -> torch.Tensor:  # what allocating per sample costs (page faults of new memory)
            return torch.empty(n, dtype=torch.uint8)

        phases = {
            "read: safe_open (mmap, no copy; old and new unpinned)": lambda: old_read(path),
            "read: one readinto a reused buffer (new, pinned path)": lambda: S.read_into_buffer(path, None, reuse),
            "read: one readinto a fresh buffer (allocated per sample)": lambda: S.read_into_buffer(path, None, fresh),
            "checksum blake3, 1 thread (old)": lambda: P.checksum(hs8, ids, algo="blake3", threads=1),
            "checksum blake3, all cores (new)": lambda: P.checksum(hs8, ids, algo="blake3", threads=0),
            "checksum xxh3-128 (new)": lambda: P.checksum(hs8, ids, algo="xxh3-128"),
            "finite: torch.isfinite (old)": lambda: bool(torch.isfinite(smp.hidden_states).all()),
            "finite: exponent bits (new)": lambda: S.all_finite(smp.hidden_states),
        }
        ptimes = {k: statistics.median(timed(fn) for _ in range(max(3, a.rounds // 2))) for k, fn in phases.items()}

        # bursts, the pool sizes interleaved burst by burst (each its own stream and socket)
        lat: dict[int, list[dict]] = {w: [] for w in a.workers}
        for _ in range(a.bursts):
            for w in a.workers:
                lat[w] += burst_latency(spool, d_b3, w, 1, a.burst_size, a.burst_gap)
        leftover = [p.name for p in spool.iterdir() if p.name.startswith("hs-burst-")]
        assert not leftover, f"the stream left files behind: {leftover}"
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
    bursts = []
    print(f"\nbursts of {a.burst_size} deliveries, notice -> handed to the loop ({a.bursts} bursts each, interleaved)")
    print(f"{'workers':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s} {'queue p50':>10s} {'check p50':>10s} "
          f"{'in-order p50':>13s} {'samples/s':>10s}")  # fmt: skip
    for w, samples in lat.items():
        ms = [r["latency_ms"] for r in samples]
        # per burst: samples / (last handed - first sent); the median over bursts
        per = [samples[i : i + a.burst_size] for i in range(0, len(samples), a.burst_size)]
        rate = statistics.median(len(b) / (max(r["handed"] for r in b) - min(r["sent"] for r in b)) for b in per)
        row = {"workers": w, "latency_ms": {"p50": round(pctl(ms, 0.5), 2), "p99": round(pctl(ms, 0.99), 2),
                                            "max": round(max(ms), 2), "n": len(ms)},
               "queue_ms_p50": round(pctl([r["queue_ms"] for r in samples], 0.5), 2),
               "check_ms_p50": round(pctl([r["check_ms"] for r in samples], 0.5), 2),
               "in_order_ms_p50": round(pctl([r["in_order_ms"] for r in samples], 0.5), 2),
               "burst_samples_per_s_p50": round(rate, 1)}  # fmt: skip
        bursts.append(row)
        print(f"{w:8d} {row['latency_ms']['p50']:8.1f} {row['latency_ms']['p99']:8.1f} {row['latency_ms']['max']:8.1f} "
              f"{row['queue_ms_p50']:10.1f} {row['check_ms_p50']:10.1f} {row['in_order_ms_p50']:13.1f} {rate:10.1f}")  # fmt: skip
    res = {
        "what": "trainer-side validation of one sample (read, shape/dtype, checksum, finiteness, token ids)",
        "command": "python bench/costs/validate_throughput.py " + " ".join(sys.argv[1:]),
        "shape": {"tokens": a.tokens, "layers": a.layers, "hidden": a.hidden, "dtype": "bfloat16", "mb": round(mb, 1)},
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
                 "note": "shared 2-core machine; GPU-host figures come from bench/online_gpu/online_gpu.py"},  # fmt: skip
        "rounds": a.rounds,
        "variants": rows,
        "phases_ms_p50": {k: round(t * 1e3, 2) for k, t in ptimes.items()},
        "bursts": {"what": "notice (sent_at) -> sample handed to the loop by HiddenStateStream, bursts of deliveries "
                           "from a stand-in sidecar (ROUTER on ipc://, files on /dev/shm), per pool size "
                           "(workers 0: checked on the iterating thread, the stream before the pool)",
                   "burst_size": a.burst_size, "bursts_each": a.bursts, "gap_s": a.burst_gap, "credit": a.burst_size,
                   "stages": "queue: delivery received -> a worker starts; check: read + checks; in_order: checked -> "
                             "handed (waiting for older samples, and for the loop)",
                   "by_workers": bursts},
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
