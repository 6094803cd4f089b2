#!/usr/bin/env python3
"""What a CPU trainer's checks of one sample cost, by how it learns that the values are finite
(``trainer_client/sample_checks.py``), and what the writer pays for saying so.

On a CPU trainer the checksum and a finiteness scan each read the whole 33.5 MB of a
Qwen3-8B-shape sample (1,024 tokens x 4 layers x 4096, bf16). This times ``load_and_check`` on
one real sample file in /dev/shm (mapped, as an unpinned stream reads it) and on one arena slot
(a view, with ``verify_slots``: checksummed as a file is; by default a stream trusts a slot and
takes no checksum of it at all, ``bench/arena/arena.py``), the arms interleaved round by round:

* ``rescan_one_pass``: one core, the scan of each chunk right after hashing it;
* ``rescan_beside``: the scan on the ``scan`` pool beside the checksum (``rescan_finite=True``);
* ``writer_verdict``: the writer's ``Notice.finite`` taken once the checksum matches (the default).

Per arm and layout: p50 / p99 ms per sample, and the process's CPU ms per sample; and the
writer's ``sample_checksum`` against ``checksum_and_finite`` (its verdict in the same pass).

    python bench/costs/host_checks.py                  # writes bench/results/host_checks_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import rank_pct  # noqa: E402
from connector import protocol as P  # noqa: E402
from connector.contract import arena as A  # noqa: E402
from connector.contract import sample_file as SF  # noqa: E402
from trainer_client import sample_checks as C  # noqa: E402
from connector import layouts as L  # noqa: E402

T, K, H = 1024, 4, 4096


def _sample(spool: Path) -> tuple[P.Deliver, P.Deliver, A.Arena]:
    """One sample as a file in ``spool`` and the same values in an arena slot there, each
    written by the connector's writer (``tests/support/sample_files.write_sample``)."""
    from tests.support import sample_files as SFX

    hs = SFX.random_hidden_states(T, K, H)
    key = P.SampleKey(job="j", epoch=0, index=0)
    kw = {"tokens": T, "layer_ids": [2, 18, 33, 36], "hidden": H, "hidden_states": hs, "key": key, "algo": "xxh3-128"}
    f = SFX.write_sample(spool, "hs-0.safetensors", **kw)
    length = SFX.slot_bytes(T, K, H)
    arena = SFX.make_arena(spool, A.PAGE + length)
    s = SFX.write_sample(spool, "hs-0", slot=SFX.slot_for(arena, A.PAGE, length), **kw)
    return f.deliver, s.deliver, arena


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench/results/host_checks_cpu.json"))
    args = ap.parse_args()
    spool = Path(tempfile.mkdtemp(prefix="hsstream-checks-", dir="/dev/shm"))
    P.claim_spool(spool)
    d_file, d_slot, arena = _sample(spool)
    maps = L.Readers(spool)
    cores = os.cpu_count() or 1
    # (C.CPUS, rescan_finite): the scan in the checksum's pass on one core, beside it on the
    # scan pool, or the writer's verdict taken (the default: no scan).
    arms = {"rescan_one_pass": (1, True), "rescan_beside": (cores, True), "writer_verdict": (cores, False)}
    times: dict[str, dict[str, list[float]]] = {a: {"files": [], "arena": []} for a in arms}
    cpu: dict[str, dict[str, float]] = {a: {"files": 0.0, "arena": 0.0} for a in arms}
    writer = {"checksum": [], "checksum_and_finite": []}
    hs = C.load_and_check(spool, d_slot, readers=maps, verify_slots=True).hidden_states.clone()
    wt = {SF.HIDDEN_STATES_KEY: hs, SF.TOKEN_IDS_KEY: torch.zeros(T, dtype=torch.int64)}
    real = C.CPUS
    try:
        for r in range(args.rounds + 2):  # 2 warm-up rounds
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                C.CPUS, rescan = arms[arm]
                for lay, d in (("files", d_file), ("arena", d_slot)):
                    c0, t0 = time.process_time(), time.perf_counter()
                    s = C.load_and_check(spool, d, readers=maps, rescan_finite=rescan,
                                          verify_slots=True)
                    dt = time.perf_counter() - t0
                    del s
                    if r >= 2:
                        times[arm][lay].append(1000 * dt)
                        cpu[arm][lay] += 1000 * (time.process_time() - c0)
            for name in (writer if r % 2 == 0 else reversed(list(writer))):  # the writer's side of it
                t0 = time.perf_counter()
                if name == "checksum":
                    SF.sample_checksum(wt, algo="xxh3-128")
                else:
                    assert SF.checksum_and_finite(wt, algo="xxh3-128")[1] is True
                if r >= 2:
                    writer[name].append(1000 * (time.perf_counter() - t0))
    finally:
        C.CPUS = real
        maps.close()
        arena.close()
        for p in spool.iterdir():
            p.unlink()
        spool.rmdir()

    res = {a: {lay: {"p50_ms": rank_pct(v, 0.5), "p99_ms": rank_pct(v, 0.99), "mean_ms": round(statistics.mean(v), 3),
                     "cpu_ms_per_sample": round(cpu[a][lay] / len(v), 3), "n": len(v)}
               for lay, v in times[a].items()} for a in arms}  # fmt: skip
    ratio = {lay: round(res["writer_verdict"][lay]["p50_ms"] / res["rescan_beside"][lay]["p50_ms"], 4)
             for lay in ("files", "arena")}  # fmt: skip
    wres = {k: {"p50_ms": rank_pct(v, 0.5), "p99_ms": rank_pct(v, 0.99)} for k, v in writer.items()}
    doc = {"benchmark": "host_checks", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python bench/costs/host_checks.py " + " ".join(sys.argv[1:]), "host": platform.node(),
           "cores": os.cpu_count(), "torch": torch.__version__,
           "shape": {"tokens": T, "layers": K, "hidden_size": H, "dtype": "bfloat16", "checksum": "xxh3-128"},
           "rounds": args.rounds, "arms": res, "verdict_vs_rescan_beside_p50": ratio, "writer": wres}  # fmt: skip
    print("| arm | layout | p50 ms | p99 ms | CPU ms/sample |\n|---|---|---|---|---|")
    for a in arms:
        for lay in ("files", "arena"):
            x = res[a][lay]
            print(f"| {a} | {lay} | {x['p50_ms']} | {x['p99_ms']} | {x['cpu_ms_per_sample']} |")
    print("writer's verdict / rescan beside, p50:", ratio)
    print("writer (one sample, hot):", wres)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
