#!/usr/bin/env python3
"""What holding a slot costs a trainer per sample (issue 40: checked bytes are trained bytes).

Since arena format 3 a trainer maps the arena copy-on-write and reads each slot under a hold
(``connector/contract/arena.py`` ``SlotReads``): a read lock on the slot's bytes taken before
its header is read, and, when its last view goes, this process's private copies of its pages
dropped (found in ``/proc/self/pagemap``) before the lock is let go. This times those parts
alone, in one process, on Qwen3-8B-shape slots (1,024 tokens x 4 layers x 4096, bf16: 33.5 MB)
of an arena in /dev/shm, every slot's pages already mapped (a stream's steady state):

* ``lock_unlock``: the read lock taken and let go (two ``fcntl`` calls);
* ``scrub``: the page map of one slot read for private pages (none: the loop wrote nothing);
* ``read_held``: the trainer's whole in-place read (``read_slot``: hold, header, views) and the
  views dropped (the finalizer: scrub, unlock), from the copy-on-write mapping;
* ``read_unheld``: the same read as arena format 2 made it, from a shared mapping, no hold, the
  baseline; ``read_held - read_unheld`` is what format 3 adds per sample;
* ``read_held_written``: ``read_held`` when the loop wrote one value of each tensor in place
  (a page copied on write, then dropped at the release).

Arms interleaved sample by sample; latencies over every sample (p50, p99, in microseconds).
The whole pipeline's figures (notice -> tensor, samples/s) are ``bench/arena/arena.py``'s.

    python bench/arena/arena_holds.py     # writes bench/results/arena_holds_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import cpu_model, rank_pct  # noqa: E402
from connector import protocol as P  # noqa: E402
from connector.contract import arena as A  # noqa: E402
from connector.contract import payload as PL  # noqa: E402
from connector.contract import sample_file as SF  # noqa: E402
from trainer_client.sample_reader import read_slot  # noqa: E402

T, K, H = 1024, 4, 4096
ARMS = ("lock_unlock", "scrub", "read_held", "read_unheld", "read_held_written")


def read_unheld(arena: A.Arena, slot: A.Slot) -> dict:
    """Arena format 2's in-place read: the header parsed, the tensors views of a shared mapping."""
    head = bytes(arena.map[slot.offset : slot.offset + A.SLOT_HEADER])
    size = A.written_size(head, slot.length)
    base = torch.from_numpy(np.frombuffer(arena.map, dtype=np.uint8, count=size, offset=slot.offset))
    spans, _ = SF.parse_header(head, size, PL.safetensors_itemsizes())
    return {n: base[sp.start : sp.end].view(PL.safetensors_torch_dtype(sp.dtype)).view(sp.shape) for n, sp in spans.items()}


def main() -> int:
    from tests.support import sample_files as SFX

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=400, help="per arm")
    ap.add_argument("--slots", type=int, default=8, help="the arena's size in slots")
    ap.add_argument("--out", default=str(ROOT / "bench/results/arena_holds_cpu.json"))
    args = ap.parse_args()
    spool = Path(tempfile.mkdtemp(prefix="hsstream-holds-", dir="/dev/shm"))
    P.claim_spool(spool)
    length = SFX.slot_bytes(T, K, H)
    made = SFX.make_arena(spool, A.PAGE + args.slots * length)
    hs = SFX.random_hidden_states(T, K, H)
    slots = []
    for i in range(args.slots):
        slot = SFX.slot_for(made, A.PAGE + i * length, length, generation=i + 1)
        SFX.write_sample(spool, f"hs-{i}", slot=slot, key=P.SampleKey(job="j", index=i), tokens=T,
                         layer_ids=[2, 18, 33, 36], hidden=H, hidden_states=hs)  # fmt: skip
        slots.append(slot)
    private = A.Arena.open(spool, private=True)
    shared = A.Arena.open(spool)
    for a in (private, shared):
        a.prefault(background=False)
    reads = private.reads
    assert reads is not None
    us: dict[str, list[float]] = {a: [] for a in ARMS}
    scrubbed0 = reads.scrubbed_pages
    try:
        for i in range(args.samples + 10):  # the first 10: warm-up
            slot = slots[i % len(slots)]
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                t0 = time.perf_counter_ns()
                if arm == "lock_unlock":
                    reads.take(slot)
                    reads.release(slot, scrub=False)
                elif arm == "scrub":
                    reads.scrub(slot.offset, slot.end)
                elif arm == "read_unheld":
                    t = read_unheld(shared, slot)
                    del t
                else:
                    t = read_slot(private, slot)
                    if arm == "read_held_written":
                        for v in t.values():
                            v.view(-1)[0] += 1  # one page of each tensor copied on write
                        del v
                    del t  # the finalizer: scrub (and drop what was written), unlock
                dt = (time.perf_counter_ns() - t0) / 1000
                if i >= 10:
                    us[arm].append(dt)
        assert reads.holds() == 0
        written_pages = reads.scrubbed_pages - scrubbed0
    finally:
        for a in (private, shared, made):
            a.close()
        shutil.rmtree(spool)
    res = {a: {"p50_us": round(rank_pct(us[a], 0.5), 1), "p99_us": round(rank_pct(us[a], 0.99), 1), "n": len(us[a])}
           for a in ARMS}  # fmt: skip
    added = round(res["read_held"]["p50_us"] - res["read_unheld"]["p50_us"], 1)
    doc = {"benchmark": "arena_holds", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python bench/arena/arena_holds.py " + " ".join(sys.argv[1:]), "host": platform.node(),
           "cpu_model": cpu_model(), "cores": os.cpu_count(), "kernel": platform.release(), "torch": torch.__version__,
           "load_avg_1": round(os.getloadavg()[0], 2),
           "shape": {"tokens": T, "layers": K, "hidden_size": H, "dtype": "bfloat16", "slot_bytes": length,
                     "slot_pages": length // A.PAGE},
           "arms": res, "added_per_sample_p50_us": added,
           "private_pages_dropped_per_written_sample": written_pages // max(1, args.samples + 10)}  # fmt: skip
    print(f"| arm | p50 µs | p99 µs | n |   (slot of {length / 1e6:.1f} MB, {length // A.PAGE} pages)\n|---|---|---|---|")
    for a in ARMS:
        print(f"| {a} | {res[a]['p50_us']} | {res[a]['p99_us']} | {res[a]['n']} |")
    print(f"format 3 adds per sample (read_held - read_unheld, p50): {added} µs")
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
