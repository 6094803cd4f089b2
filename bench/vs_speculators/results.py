"""The study's result, from its JSON: the checks that make it the comparison it claims, the
comparison itself, the table docs/benchmarks.md holds, and the plot. Pure (no torch, no vLLM),
so that the unit tests can hand it wrong results and see each check fail
(tests/unit/bench/test_vs_speculators.py), and the figure test can hold the doc to the JSON
(tests/unit/project/test_vs_speculators_in_docs.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

ARMS = ("ours", "speculators")
LABEL = {"ours": "ours: online (`hsstream up` stack + `hsstream train` from the stream)",
         "speculators": "speculators 0.9.0: `prepare-data`, vLLM + Example connector, `generate-offline-data`, `train`"}  # fmt: skip
SHORT = {"ours": "ours (online)", "speculators": "speculators (offline)"}

#: The settings both arms must have run with, as each arm's own artifacts record them.
SETTINGS = ("draft_vocab_size", "aux_layer_ids", "steps", "samples_per_step", "lr", "weight_decay", "betas",
            "schedule", "min_lr_ratio", "warmup_steps", "ttt_steps", "ttt_step_loss_decay", "grad_clip", "loss",
            "draft_attn_impl", "seed", "epochs", "precision", "torch_threads")  # fmt: skip
#: The draft's config keys that define its architecture (speculators' Eagle3SpeculatorConfig).
ARCH_KEYS = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "embed_requires_grad", "fc_norm", "norm_before_fc",
             "norm_before_residual", "norm_output", "speculators_model_type", "target_hidden_size")  # fmt: skip
LAYER_KEYS_IGNORED = ("dtype", "torch_dtype", "transformers_version", "_name_or_path", "pad_token_id", "bos_token_id",
                      "eos_token_id")  # fmt: skip

DOC_BEGIN = "<!-- vs-speculators:begin (written by `python -m bench.vs_speculators --write-doc`) -->"
DOC_END = "<!-- vs-speculators:end -->"
NOT_RUN = "The full run has not been made yet"


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def arch_of(config: dict) -> dict:
    """The architecture-defining part of a speculators draft config."""
    layer = {k: v for k, v in (config.get("transformer_layer_config") or {}).items() if k not in LAYER_KEYS_IGNORED}
    return {**{k: config.get(k) for k in ARCH_KEYS}, "transformer_layer_config": layer}


def settings_equal(a: dict, b: dict) -> dict[str, bool]:
    """Per setting: both arms recorded it and the values agree (floats to 1e-12)."""
    out = {}
    for k in SETTINGS:
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            out[k] = False
        elif isinstance(x, float) or isinstance(y, float):
            out[k] = isinstance(x, int | float) and isinstance(y, int | float) and math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15)
        else:
            out[k] = x == y
    return out


def affinity_ok(arms: dict) -> bool:
    """Each arm recorded its cores, all equal, producer and trainer apart (when there are two cores)."""
    seen = [arms[a].get("affinity") for a in ARMS]
    if any(not s for s in seen) or any(s != seen[0] for s in seen[1:]):
        return False
    p, t = set(seen[0].get("producer") or []), set(seen[0].get("trainer") or [])
    return bool(p) and bool(t) and (not (p & t) or p == t)


def curve_ok(curve: list[dict]) -> bool:
    """Every point has both temperatures' mean acceptance length and rate, and time moves forward."""
    if not curve:
        return False
    for p in curve:
        for t in ("T0", "T1"):
            v = p.get(t) or {}
            if not isinstance(v.get("mean_acceptance_length"), int | float) or not isinstance(v.get("acceptance_rate"), int | float):
                return False
    ts = [p["t_s"] for p in curve]
    return all(b > a for a, b in zip(ts, ts[1:])) and ts[0] > 0


def checks(r: dict) -> dict[str, bool]:
    """The study's checks (all must hold for the result to be the comparison it claims)."""
    arms, data, sz = r["arms"], r["data"], r["sizes"]
    ours, spec = arms["ours"], arms["speculators"]
    n, n_val = sz["conversations"], sz["val_rows"]
    st = settings_equal(ours.get("settings") or {}, spec.get("settings") or {})
    c = {
        # the same conversations (token ids and loss masks as each trainer received them)
        "same_samples": ours.get("samples_hash") == spec.get("samples_hash") == data.get("train_hash") is not None,
        "samples_all_of_their_length": ours.get("sample_lengths") == spec.get("sample_lengths") == [sz["tokens"]],
        # the same held-out prompts served for every point, disjoint from training (by content)
        "held_out_disjoint": bool(data.get("held_out_disjoint")),
        "same_held_out_prompts": len({p.get("prompts_hash") for p in _all_points(r)} | {data.get("prompts_hash")}) == 1,
        # every record read and every sample accounted for
        "records_accounted": bool((data.get("ledger") or {}).get("accounted")),
        "ours_every_sample_trained_once": (ours.get("trained_keys") == n and ours.get("trained_twice") == 0
                                           and ours.get("ledger_samples") == n and (ours.get("job") or {}).get("done") is True),
        "speculators_every_sample_written_and_trained": (spec.get("hidden_state_files") == n + n_val
                                                         and spec.get("steps") == n),
        "spool_empty_after_ours": ours.get("spool_files_left") == 0,
        # the same draft, vocabulary, recipe and cores
        "same_settings": all(st.values()),
        "same_draft_architecture": bool(ours.get("arch")) and ours.get("arch") == spec.get("arch"),
        "same_vocab_maps": bool(r.get("vocab_maps_equal")),
        "same_cores": affinity_ok(arms),
        "points_per_curve_ge_min": all(len(arms[a].get("curve") or []) >= sz["points"] for a in ARMS),
        "curves_complete": all(curve_ok(arms[a].get("curve") or []) for a in ARMS),
    }
    return c


def _all_points(r: dict) -> list[dict]:
    pts = [p for a in ARMS for p in (r["arms"][a].get("curve") or [])]
    return pts + [x for x in (r.get("untrained"), r.get("no_draft")) if x]


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


def mal(p: dict | None, t: str = "T0") -> float | None:
    return ((p or {}).get(t) or {}).get("mean_acceptance_length")


def first_reaching(curve: list[dict], target: float, t: str = "T0") -> dict | None:
    """The first point of ``curve`` whose mean acceptance length at ``t`` is at least ``target``."""
    for p in curve:
        v = mal(p, t)
        if v is not None and v >= target:
            return p
    return None


def comparison(r: dict) -> dict:
    """Does ours reach the speculators arm's final mean acceptance length (T=0) no later in
    wall-clock? By how much; and how far each trained draft got above the untrained one."""
    ours, spec = r["arms"]["ours"]["curve"], r["arms"]["speculators"]["curve"]
    target, t_spec = mal(spec[-1]), spec[-1]["t_s"]
    hit = first_reaching(ours, target) if target is not None else None
    u0, u1 = mal(r.get("untrained"), "T0"), mal(r.get("untrained"), "T1")
    out = {
        "speculators_final": {"t_s": t_spec, "T0": target, "T1": mal(spec[-1], "T1")},
        "ours_final": {"t_s": ours[-1]["t_s"], "T0": mal(ours[-1]), "T1": mal(ours[-1], "T1")},
        "ours_reaches_speculators_final_at_s": hit["t_s"] if hit else None,
        "ours_reaches_no_later": bool(hit and hit["t_s"] <= t_spec),
        "ours_wall_saved_s": round(t_spec - hit["t_s"], 1) if hit else None,
        "ours_final_minus_speculators_final_T0": round(mal(ours[-1]) - target, 4) if target is not None and mal(ours[-1]) is not None else None,
        "untrained": {"T0": u0, "T1": u1},
        "trained_minus_untrained_T0": {a: round(mal(r["arms"][a]["curve"][-1]) - u0, 4) if u0 is not None else None for a in ARMS},
        "tokens_per_s_T0": {"no_draft": ((r.get("no_draft") or {}).get("T0") or {}).get("tokens_per_s"),
                            **{a: (r["arms"][a]["curve"][-1].get("T0") or {}).get("tokens_per_s") for a in ARMS}},
    }  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Tables (the doc's and the terminal's)
# --------------------------------------------------------------------------------------------


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _mb(x: int | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.1f} MB"


def summary_table(r: dict) -> str:
    """One row per arm (its final checkpoint), then the untrained draft and the verifier alone."""
    rows = ["| arm | steps | final checkpoint (s after the first request) | mean acceptance length T=0 / T=1 | "
            "acceptance rate T=0 / T=1 | tokens/s with the draft (T=0) | peak disk: data / checkpoints | peak /dev/shm |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for a in ARMS:
        x = r["arms"][a]
        p = x["curve"][-1]
        disk = x.get("disk_peak_bytes") or {}
        data = disk.get("hidden_states", 0) + disk.get("staging", 0) + disk.get("prepared", 0) if a == "speculators" else 0
        rows.append(f"| {SHORT[a]} | {x['steps']:,} | {p['t_s']:,.0f} | {_f(mal(p))} / {_f(mal(p, 'T1'))} | "
                    f"{_f(p['T0']['acceptance_rate'])} / {_f(p['T1']['acceptance_rate'])} | {_f(p['T0']['tokens_per_s'], 1)} | "
                    f"{_mb(data)} / {_mb(disk.get('checkpoints'))} | {_mb(x.get('shm_peak_bytes'))} |")  # fmt: skip
    u, nd = r.get("untrained") or {}, r.get("no_draft") or {}
    if u:
        rows.append(f"| untrained draft | 0 | - | {_f(mal(u))} / {_f(mal(u, 'T1'))} | {_f(u['T0']['acceptance_rate'])} / "
                    f"{_f(u['T1']['acceptance_rate'])} | {_f(u['T0']['tokens_per_s'], 1)} | - | - |")  # fmt: skip
    if nd:
        rows.append(f"| verifier alone (no draft) | - | - | - | - | {_f(nd['T0']['tokens_per_s'], 1)} | - | - |")
    return "\n".join(rows)


def curve_table(r: dict) -> str:
    rows = ["| arm | step | s after the first request | mean acceptance length T=0 | T=1 | acceptance rate T=0 | T=1 |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for a in ARMS:
        for p in r["arms"][a]["curve"]:
            rows.append(f"| {SHORT[a]} | {p['step']:,} | {p['t_s']:,.0f} | {_f(mal(p))} | {_f(mal(p, 'T1'))} | "
                        f"{_f(p['T0']['acceptance_rate'])} | {_f(p['T1']['acceptance_rate'])} |")  # fmt: skip
    return "\n".join(rows)


def verdict(r: dict) -> str:
    """The sentence the issue asks for, whatever the outcome."""
    c = r["comparison"]
    tgt = c["speculators_final"]
    if c["ours_reaches_no_later"]:
        return (f"Ours reaches the speculators arm's final mean acceptance length at T=0 ({_f(tgt['T0'])}, at "
                f"{tgt['t_s']:,.0f} s) at {c['ours_reaches_speculators_final_at_s']:,.0f} s: "
                f"{c['ours_wall_saved_s']:,.0f} s earlier.")  # fmt: skip
    if c["ours_reaches_speculators_final_at_s"] is not None:
        return (f"Ours does **not** reach the speculators arm's final mean acceptance length at T=0 ({_f(tgt['T0'])}) "
                f"sooner: it gets there at {c['ours_reaches_speculators_final_at_s']:,.0f} s, "
                f"{-c['ours_wall_saved_s']:,.0f} s after the speculators arm ({tgt['t_s']:,.0f} s).")  # fmt: skip
    return (f"Ours does **not** reach the speculators arm's final mean acceptance length at T=0 ({_f(tgt['T0'])}): its "
            f"final checkpoint ({c['ours_final']['t_s']:,.0f} s) is at {_f(c['ours_final']['T0'])}, "
            f"{_f(-c['ours_final_minus_speculators_final_T0'])} short.")  # fmt: skip


def doc_section(r: dict | None, json_path: str) -> str:
    """The docs/benchmarks.md section between the markers: the tables from ``r``; without a
    result, a statement that the full run has not been made (no figures)."""
    if r is None:
        return (f"{DOC_BEGIN}\n{NOT_RUN}: there is no `{json_path}`. The table is written from it by "
                f"`python -m bench.vs_speculators --write-doc` once the run has been made.\n{DOC_END}")
    c, sz = r["comparison"], r["sizes"]
    failed = [k for k, v in r["checks"].items() if not v]
    parts = [
        DOC_BEGIN,
        f"From `{json_path}` ({r['mode']} run, {r.get('date', '')}; `{r['command']}`; {r['wall_s_total'] / 60:.1f} min in all). "
        f"Verifier: {r['verifier']['label']}. {sz['conversations']:,} ShareGPT conversations of {sz['tokens']} tokens each, "
        f"draft vocabulary {sz['draft_vocab']:,}, one epoch ({r['arms']['ours']['steps']:,} steps of one sample); "
        f"{sz['prompts']} held-out prompts × {sz['max_tokens']} tokens served per point. "
        + ("Every check passed." if not failed else f"**Checks failed: {', '.join(failed)}.**"),
        "",
        summary_table(r),
        "",
        curve_table(r),
        "",
        verdict(r) + f" Trained minus untrained mean acceptance length at T=0: ours "
        f"{_f(c['trained_minus_untrained_T0']['ours'])}, speculators {_f(c['trained_minus_untrained_T0']['speculators'])}.",
        DOC_END,
    ]  # fmt: skip
    return "\n".join(parts)


def replace_section(doc: str, section: str) -> str:
    pat = re.compile(re.escape(DOC_BEGIN) + ".*?" + re.escape(DOC_END), re.S)
    if not pat.search(doc):
        raise ValueError("docs/benchmarks.md has no vs-speculators section markers")
    return pat.sub(lambda _m: section, doc, count=1)


def current_section(doc: str) -> str | None:
    m = re.search(re.escape(DOC_BEGIN) + ".*?" + re.escape(DOC_END), doc, re.S)
    return m.group(0) if m else None


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------


def plot(r: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, t in zip(axes, ("T0", "T1")):
        for a, style in zip(ARMS, ("o-", "s--")):
            cv = r["arms"][a]["curve"]
            ax.plot([0] + [p["t_s"] for p in cv], [mal(r.get("untrained"), t) or 1.0] + [mal(p, t) for p in cv], style,
                    label=SHORT[a])  # fmt: skip
        u = mal(r.get("untrained"), t)
        if u is not None:
            ax.axhline(u, color="grey", lw=0.8, ls=":", label="untrained draft")
        ax.set_title(f"T={t[1]}")
        ax.set_xlabel("s after the first request")
        ax.set_ylabel("mean acceptance length (vLLM, k=3)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{r['verifier']['label']}: {r['sizes']['conversations']:,} ShareGPT conversations, {r['mode']} run", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
