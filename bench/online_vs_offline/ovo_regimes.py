"""The regimes of ``bench/online_vs_offline/online_vs_offline.py --regime``: their sizes, and the pure logic that
makes each comparison what it claims (core split, shard plan, reply differences, checks).

Kept apart from the runner so that it can be unit-tested without vLLM: every check here must be
able to fail on a run that is not the regime it names (tests/unit/bench/test_ovo_regimes.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

#: Regime names as ``--regime`` and the result file take them.
REGIMES = ("balanced", "disk_limited", "fresh_replies")

#: The balanced regime's ratio of producing one sample's states to one training step on it.
BALANCE_RANGE = (0.5, 2.0)
#: The disk-limited regime: offline's disk budget as a share of the dataset's states, and the
#: fewest shards it must run in.
DISK_SHARE = 0.1
MIN_SHARDS = 10
#: Fresh replies: the least share of replies that must differ between consecutive epochs at T=1.
MIN_FRESH_SHARE = 0.5


@dataclass(frozen=True)
class Sizes:
    """What a regime runs: documents, epoch settings (one offline+online pair each), served
    points per arm, and (balanced) the verifier's depth."""

    samples: int
    epochs: tuple[int, ...]
    max_points: int
    grid_s: float
    verifier_layers: int = 12
    eval_every: int = 200
    eval_samples: int = 8
    eval_prompts: int = 32
    max_tokens: int = 64
    regen_max_tokens: int = 64
    extra: dict = field(default_factory=dict)


#: Full sizes, chosen so that the three regimes together fit in an hour on the 2-core machine
#: (the estimate each smoke run prints is what they were chosen from), and smoke sizes.
FULL = {
    "balanced": Sizes(samples=480, epochs=(1, 3), max_points=4, grid_s=3.0, verifier_layers=60),
    "disk_limited": Sizes(samples=400, epochs=(2,), max_points=4, grid_s=5.0),
    "fresh_replies": Sizes(samples=300, epochs=(3,), max_points=4, grid_s=5.0),
}
SMOKE = {
    "balanced": Sizes(samples=30, epochs=(1, 2), max_points=2, grid_s=2.0, verifier_layers=60, eval_every=20,
                      eval_samples=4, eval_prompts=4, max_tokens=16),  # fmt: skip
    "disk_limited": Sizes(samples=40, epochs=(1,), max_points=2, grid_s=5.0, eval_every=20, eval_samples=4,
                          eval_prompts=4, max_tokens=16),  # fmt: skip
    "fresh_replies": Sizes(samples=30, epochs=(2,), max_points=2, grid_s=5.0, eval_every=20, eval_samples=4,
                           eval_prompts=4, max_tokens=16, regen_max_tokens=24),  # fmt: skip
}


# --------------------------------------------------------------------------------------------
# Core split
# --------------------------------------------------------------------------------------------


def split_cores(cores: set[int] | list[int]) -> dict[str, list[int]]:
    """The producer (vLLM, and the sidecar in online arms) on the lower half of the cores, the
    trainer on the rest; the same split in every arm, so arms differ in the data path only. One
    core: both share it (recorded as such, the comparison then is of a shared core)."""
    cs = sorted(set(cores))
    if not cs:
        raise ValueError("no CPU cores to split")
    if len(cs) == 1:
        return {"producer": cs, "trainer": cs}
    half = len(cs) // 2
    return {"producer": cs[:half], "trainer": cs[half:]}


def omp_bind(cores: list[int]) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for a contiguous list of cores."""
    cs = sorted(cores)
    if cs != list(range(cs[0], cs[-1] + 1)):
        return ",".join(map(str, cs))
    return f"{cs[0]}-{cs[-1]}" if len(cs) > 1 else str(cs[0])


def affinities_equal(arms: dict[str, dict]) -> bool:
    """Each arm recorded its cores (producer, vLLM's OpenMP binding, trainer) and all are equal,
    with producer and trainer apart when there are two cores or more."""
    seen = [a.get("affinity") for a in arms.values()]
    if not seen or any(s is None for s in seen):
        return False
    first = seen[0]
    if not first["producer"] or not first["trainer"] or any(s != first for s in seen[1:]):
        return False
    return not (set(first["producer"]) & set(first["trainer"])) or len(set(first["producer"]) | set(first["trainer"])) == 1


# --------------------------------------------------------------------------------------------
# Shards (disk-limited offline)
# --------------------------------------------------------------------------------------------


def sample_bytes_estimate(n_tokens: int, n_layers: int, hidden: int, dtype_bytes: int = 2, overhead: int = 4096) -> int:
    """Bytes of one sample's file: the states ([T, K, H] bf16), its token ids (int64), and a
    header (notice, safetensors metadata) bounded by ``overhead``."""
    return n_tokens * (n_layers * hidden * dtype_bytes + 8) + overhead


def plan_shards(sizes: list[int], budget: int, min_shards: int = MIN_SHARDS) -> list[list[int]]:
    """Consecutive shards of sample indices whose bytes each fit ``budget``, at least
    ``min_shards`` of them: greedily filled, then the largest split until there are enough.
    Raises if one sample alone exceeds the budget or there are fewer samples than shards."""
    if budget <= 0:
        raise ValueError("budget must be positive")
    if len(sizes) < min_shards:
        raise ValueError(f"{len(sizes)} samples cannot make {min_shards} shards")
    if sizes and max(sizes) > budget:
        raise ValueError(f"one sample ({max(sizes)} B) exceeds the budget ({budget} B)")
    shards: list[list[int]] = []
    cur: list[int] = []
    cur_b = 0
    for i, b in enumerate(sizes):
        if cur and cur_b + b > budget:
            shards.append(cur)
            cur, cur_b = [], 0
        cur.append(i)
        cur_b += b
    if cur:
        shards.append(cur)
    while len(shards) < min_shards:
        j = max(range(len(shards)), key=lambda k: (len(shards[k]) > 1, sum(sizes[i] for i in shards[k])))
        s = shards[j]
        shards[j : j + 1] = [s[: len(s) // 2], s[len(s) // 2 :]]
    return shards


# --------------------------------------------------------------------------------------------
# Fresh replies
# --------------------------------------------------------------------------------------------


def reply_differences(rows: list[tuple[int, int, str]]) -> dict:
    """From the (epoch, index, token-ids digest) the online trainer saw: for each pair of
    consecutive epochs, the share of indices seen in both whose tokens differ; ``min_share``
    is the smallest (None with fewer than two epochs or nothing in common)."""
    by: dict[int, dict[int, str]] = defaultdict(dict)
    for e, i, d in rows:
        by[int(e)][int(i)] = d
    epochs = sorted(by)
    pairs = []
    for a, b in zip(epochs, epochs[1:]):
        common = sorted(set(by[a]) & set(by[b]))
        diff = sum(by[a][i] != by[b][i] for i in common)
        pairs.append({"epochs": [a, b], "common": len(common), "differ": diff,
                      "share": round(diff / len(common), 4) if common else None})  # fmt: skip
    shares = [p["share"] for p in pairs if p["share"] is not None]
    return {"pairs": pairs, "min_share": min(shares) if shares and len(shares) == len(pairs) else None}


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def regime_checks(regime: str, r: dict) -> dict[str, bool]:
    """The checks that say the run is the regime it names. ``r`` carries the measured facts:
    ``arms`` (each with ``steps``, ``affinity``) and per regime ``balance_ratio`` (balanced, one
    per offline arm), ``disk`` (disk-limited: ``budget``, ``dataset_bytes``, ``offline_peak``,
    ``shards``, ``spool_peak``), ``reply_differences`` (fresh replies)."""
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}")
    arms = r["arms"]
    pairs = r.get("pairs") or [list(arms)]
    checks = {
        "equal_steps_per_arm": all(len({arms[a]["steps"] for a in p}) == 1 and arms[p[0]]["steps"] > 0 for p in pairs),
        "affinity_recorded_and_equal": affinities_equal(arms),
    }
    if regime == "balanced":
        ratios = r["balance_ratio"]
        lo, hi = BALANCE_RANGE
        checks["produce_over_train_step_in_range"] = bool(ratios) and all(lo <= x <= hi for x in ratios.values())
    elif regime == "disk_limited":
        d = r["disk"]
        checks["budget_is_a_tenth_of_the_dataset"] = d["dataset_bytes"] > 0 and math.isclose(
            d["budget"] / d["dataset_bytes"], DISK_SHARE, rel_tol=0.25
        )
        checks["offline_peak_data_le_budget"] = 0 < d["offline_peak"] <= d["budget"]
        checks["offline_shards_ge_min"] = d["shards"] >= MIN_SHARDS
        checks["online_spool_peak_le_budget"] = 0 < d["spool_peak"] <= d["budget"]
    else:
        share = r["reply_differences"]["min_share"]
        checks["fresh_replies_differ_between_epochs"] = share is not None and share >= MIN_FRESH_SHARE
    return checks


# --------------------------------------------------------------------------------------------
# A deeper verifier with the pre-trained one's outputs
# --------------------------------------------------------------------------------------------


def padded_verifier(src: str | Path, num_layers: int, cache_root: str | Path | None = None) -> Path:
    """The pre-trained tiny verifier deepened to ``num_layers`` by appending layers that leave the
    residual stream unchanged (attention output and MLP down projections zero; the rest copies
    of its last layer): its hidden states at the original layers, its final state and its
    replies are the pre-trained model's, while vLLM computes every layer, so producing a
    sample's states costs what a model of that depth costs. Training on them costs the same
    (the draft reads three layers and the last). Cached beside the source, built once."""
    import torch
    from safetensors.torch import load_file, save_file

    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    n0 = int(cfg["num_hidden_layers"])
    if num_layers <= n0:
        return src
    root = Path(cache_root) if cache_root else src.parent
    out = root / f"{src.name}-padded{num_layers}"
    if (out / "PADDED_OK").exists():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=root))
    try:
        w = load_file(str(src / "model.safetensors"))
        last = f"model.layers.{n0 - 1}."
        for k in range(n0, num_layers):
            for name, t in list(w.items()):
                if name.startswith(last):
                    new = f"model.layers.{k}." + name[len(last) :]
                    zero = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                    w[new] = torch.zeros_like(t) if zero else t.clone()
        save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg["num_hidden_layers"] = num_layers
        if isinstance(cfg.get("layer_types"), list):
            cfg["layer_types"] = (cfg["layer_types"] + [cfg["layer_types"][-1]] * num_layers)[:num_layers]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for f in src.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json"):
                shutil.copy2(f, tmp / f.name)
        (tmp / "PADDED_OK").write_text(f"{src.name} + {num_layers - n0} identity layers\n")
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def layers_for(num_layers: int) -> list[int]:
    """The layers extracted: the draft's three (as for the 12-layer verifier) and the last."""
    return [2, 6, 9, num_layers]


def time_to_reach(curve: list[dict], target: float, key: str) -> float | None:
    """Wall-clock (s) of the first served point of ``curve`` at or above ``target`` (None: never)."""
    for p in curve:
        if p[key] >= target:
            return p["t_s"]
    return None


def arm_epochs(arm: dict) -> int:
    """The epochs an arm trained: offline records them, an online arm's job options carry them."""
    return int(arm.get("epochs") or arm["jobs"][0]["options"].get("epochs", 1))


def estimate_wall_s(smoke: dict, smoke_sizes: Sizes, full: Sizes) -> float:
    """A full run's wall time from a smoke run's parts: per arm, vLLM's start and the trainer's
    start-up as they were, producing and training (the training loop, offline's writing before
    it) by samples × epochs; serving by the number of served points; the rest (setup, the
    verifier) as it was."""
    arms = smoke["arms"]
    per_pair_s = len(arms) // max(1, len(smoke_sizes.epochs))
    scale = full.samples / smoke_sizes.samples
    total = 0.0
    for e_full, e_smoke in zip(full.epochs, smoke_sizes.epochs, strict=True):
        pair = [a for a in arms.values() if arm_epochs(a) == e_smoke][:per_pair_s]
        for a in pair:
            var = a["result"]["wall_s"] + (a.get("phases_s", {}).get("generate", 0.0) if "shard_log" not in a else 0.0)
            total += a["vllm_start_s"] + max(0.0, a["wall_s"] - var) + var * scale * e_full / e_smoke
    points = sum(len(a["curve"]) for a in arms.values()) + 1
    per_point = smoke["serving"]["wall_s"] / points
    used = smoke["serving"]["wall_s"] + sum(a["vllm_start_s"] + a["wall_s"] for a in arms.values())
    n_arms = 2 * len(full.epochs)
    return round(total + per_point * (n_arms * full.max_points + 1) + max(0.0, smoke["wall_s_total"] - used))
