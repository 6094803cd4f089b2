#!/usr/bin/env python3
"""What a process's first touch of an arena slot costs, with and without the prefault
(``Arena.prefault``: ``MADV_POPULATE_READ``, which the connector and the trainers run ahead of
the slots they are handed and the sidecar over the whole arena when it makes it).

A process that maps the arena has no page-table entries for it yet: its first read of a slot
faults the pages in, a few at a time, although the writer's process wrote them and they sit in
memory. A stream that opens the arena (every new ``HiddenStateStream``) paid that once per slot
on its first pass over the arena (``bench/arena/arena.py`` opens a stream per job: most of its paced
samples were such first touches, in the runs before it); since the prefault it does not. This times the stream's check
of one Qwen3-8B-shape slot (1,024 tokens x 4 layers x 4096, bf16: 33.5 MB; ``load_and_check``,
the writer's verdict taken, with ``verify_slots``: a pass over the slot's bytes, as a CPU stream
ran it before slots were trusted, and as it still runs for a file), the arms interleaved round by round, each
round on a slot just rewritten through the writer's own mapping:

* ``fresh``: the first check in a new mapping, no prefault (the stream before it);
* ``prefaulted``: the first check in a new mapping once its prefault is done;
* ``mapped``: a second check in the same mapping (a stream's steady state).

And the prefault's own cost (ms per GiB, the arena's pages already in memory), and the minor
page faults of each arm's check.

    python bench/arena/arena_pages.py     # writes bench/results/arena_pages_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import cpu_model, rank_pct  # noqa: E402
from connector import protocol as P  # noqa: E402
from connector.contract import arena as A  # noqa: E402
from trainer_client import sample_checks as C  # noqa: E402
from connector import layouts as L  # noqa: E402

T, K, H = 1024, 4, 4096
ARMS = ("fresh", "prefaulted", "mapped")


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def main() -> int:
    from tests.support import sample_files as SFX

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--slots", type=int, default=16, help="the arena's size in slots (the bench's budget)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/arena_pages_cpu.json"))
    args = ap.parse_args()
    spool = Path(tempfile.mkdtemp(prefix="hsstream-pages-", dir="/dev/shm"))
    P.claim_spool(spool)
    length = SFX.slot_bytes(T, K, H)
    made = SFX.make_arena(spool, A.PAGE + args.slots * length)  # the sidecar's (reserved, prefaulted)
    made.prefault(background=False)
    hs = SFX.random_hidden_states(T, K, H)
    kw = {"tokens": T, "layer_ids": [2, 18, 33, 36], "hidden": H, "hidden_states": hs, "algo": "xxh3-128"}
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    flt: dict[str, list[int]] = {a: [] for a in ARMS}
    prefault_ms: list[float] = []
    try:
        for r in range(args.rounds + 1):  # round 0: warm-up
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            for arm in order:
                # A slot of its own per round and arm, just rewritten through the writer's mapping.
                off = A.PAGE + (r * len(ARMS) + ARMS.index(arm)) % args.slots * length
                key = P.SampleKey(job="j", epoch=0, index=r)
                d = SFX.write_sample(spool, f"hs-{r}", slot=SFX.slot_for(made, off, length, generation=r + 1),
                                     key=key, **kw).deliver  # fmt: skip
                for t in threading.enumerate():  # the writer's own prefault of its mapping: not timed here
                    if t.name == "hsstream-arena-prefault":
                        t.join()
                maps = L.Readers(spool, {"arena": {"prefault": False}})
                arena = maps.get("arena").maps().get(d.notice.slot)  # a new mapping of the arena, no page of it in our tables
                if arm == "prefaulted":
                    t0 = time.perf_counter()
                    arena.prefault(background=False)
                    if r:
                        prefault_ms.append(1000 * (time.perf_counter() - t0) / (arena.size / 2**30))
                elif arm == "mapped":
                    C.load_and_check(spool, d, readers=maps, verify_slots=True)
                f0, t0 = faults(), time.perf_counter()
                s = C.load_and_check(spool, d, readers=maps, verify_slots=True)
                dt, nf = time.perf_counter() - t0, faults() - f0
                del s
                maps.close()
                if r:
                    times[arm].append(1000 * dt)
                    flt[arm].append(nf)
    finally:
        made.close()
        shutil.rmtree(spool)

    res = {a: {"p50_ms": rank_pct(times[a], 0.5), "p99_ms": rank_pct(times[a], 0.99),
               "faults_p50": rank_pct(flt[a], 0.5), "n": len(times[a])} for a in ARMS}  # fmt: skip
    ratio = round(res["prefaulted"]["p50_ms"] / res["fresh"]["p50_ms"], 4)
    doc = {"benchmark": "arena_pages", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python bench/arena/arena_pages.py " + " ".join(sys.argv[1:]), "host": platform.node(),
           "cpu_model": cpu_model(), "cores": os.cpu_count(), "kernel": platform.release(), "torch": torch.__version__,
           "shape": {"tokens": T, "layers": K, "hidden_size": H, "dtype": "bfloat16", "checksum": "xxh3-128",
                     "slot_bytes": length, "arena_bytes": A.PAGE + args.slots * length},
           "rounds": args.rounds, "arms": res, "prefaulted_vs_fresh_p50": ratio,
           "first_touch_ms": round(res["fresh"]["p50_ms"] - res["mapped"]["p50_ms"], 3),
           "prefault_ms_per_gib": {"p50": rank_pct(prefault_ms, 0.5), "p99": rank_pct(prefault_ms, 0.99)},
           "checks": {"prefault_removes_the_faults": res["prefaulted"]["faults_p50"] < res["fresh"]["faults_p50"] / 100,
                      "prefaulted_faster_than_fresh": ratio < 1}}  # fmt: skip
    print("| arm | p50 ms | p99 ms | minor faults p50 |\n|---|---|---|---|")
    for a in ARMS:
        print(f"| {a} | {res[a]['p50_ms']} | {res[a]['p99_ms']} | {res[a]['faults_p50']} |")
    print("prefaulted / fresh p50:", ratio, " prefault ms/GiB:", doc["prefault_ms_per_gib"], " checks:", doc["checks"])
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", args.out)
    return 0 if all(doc["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
