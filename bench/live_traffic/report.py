"""docs/benchmarks.md's live-traffic section, written from ``bench/results/live_traffic_cpu.json``
(``python -m bench.live_traffic.report --write-doc``): every figure from the JSON, whatever the
outcome; without the JSON, the section says the study has not run and quotes no figure.
``tests/unit/project/test_live_traffic_in_docs.py`` holds the page to it."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "live_traffic_cpu.json"
REL = "bench/results/live_traffic_cpu.json"
BEGIN, END = "<!-- live-traffic:begin -->", "<!-- live-traffic:end -->"
NOT_RUN = "The study has not run on the real model yet"


def load(path: Path = RESULT) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def mal(arm: dict, shift_at: float, after: bool) -> float | None:
    """The served mean acceptance length over an arm's windows before (or after) the shift,
    weighted by the drafts of each window (vLLM's own counters)."""
    ws = [w for w in arm.get("windows", []) if w.get("mean_acceptance_length") is not None and w.get("drafts")
          and ((w["t"] > shift_at) if after else (w["t"] <= shift_at))]  # fmt: skip
    n = sum(w["drafts"] for w in ws)
    return round(sum(w["mean_acceptance_length"] * w["drafts"] for w in ws) / n, 4) if n else None


def summary(r: dict) -> dict:
    """Per arm over the rounds: acceptance after the shift, its spread, and the issue's check."""
    s = r["shift_at_s"]
    out: dict = {}
    for arm in ("static", "live"):
        after = [mal(rnd[arm], s, True) for rnd in r["rounds"]]
        vals = [x for x in after if x is not None]
        out[arm] = {"after_shift": after, "mean_after_shift": round(statistics.fmean(vals), 4) if vals else None,
                    "spread_after_shift": round(max(vals) - min(vals), 4) if len(vals) > 1 else None}  # fmt: skip
    st, lv = out["static"], out["live"]
    diff = None if st["mean_after_shift"] is None or lv["mean_after_shift"] is None else round(
        lv["mean_after_shift"] - st["mean_after_shift"], 4)
    out["live_minus_static_after_shift"] = diff
    out["live_above_static_by_more_than_its_spread"] = (
        None if diff is None or st["spread_after_shift"] is None else diff > st["spread_after_shift"])
    out["failed_requests"] = sum(len(rnd[a].get("failed") or []) for rnd in r["rounds"] for a in ("static", "live"))
    tried = [x for rnd in r["rounds"] for x in rnd["live"].get("swaps") or []]
    out["swaps"] = sum(1 for x in tried if x.get("result") == "done")
    out["swaps_refused_by_gate"] = sum(1 for x in tried if x.get("result") == "refused_by_gate")
    out["checks_all_true"] = all(v is not False for rnd in r["rounds"] for a in ("static", "live")
                                 for v in rnd[a].get("checks", {}).values())  # fmt: skip
    return out


def mal_last(arm: dict, duration_s: float, last_s: float) -> float | None:
    """The served mean acceptance length over the windows that end in the replay's last ``last_s``."""
    ws = [w for w in arm.get("windows", []) if w.get("mean_acceptance_length") is not None and w.get("drafts")
          and w["t"] > duration_s - last_s]  # fmt: skip
    n = sum(w["drafts"] for w in ws)
    return round(sum(w["mean_acceptance_length"] * w["drafts"] for w in ws) / n, 4) if n else None


def swap_rows(r: dict) -> list[str]:
    """One table row per gate decision of the live arms: version, result, the gate's figures."""
    rows = []
    for rnd in r["rounds"]:
        for x in rnd["live"].get("swaps") or []:
            g = x.get("gate") or {}
            rows.append(f"| {rnd['round']} | {x.get('from', '–')} → {x.get('to', '–')} | {x.get('result', '–')} | "
                        f"{g.get('prompts', '–')} | {_f(g.get('live'))} | {_f(g.get('new'))} | "
                        f"{_f(g.get('seconds'), 0)} | {_f(x.get('seconds'), 1)} |")  # fmt: skip
    return rows


def _swaps(arm: dict) -> str:
    """Swaps done / gate decisions (a refused one is a decision too)."""
    tried = arm.get("swaps") or []
    return f"{sum(1 for x in tried if x.get('result') == 'done')} / {len(tried)}"


def _f(x: float | None, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def doc_section(r: dict | None, rel: str = REL) -> str:
    if r is None:
        return f"{BEGIN}\n{NOT_RUN} (`python bench/live_traffic/study.py --model MODEL --draft DRAFT --data-a SHAREGPT` writes `{rel}`).\n{END}"
    sm = summary(r)
    s = r["shift_at_s"]
    lines = [BEGIN, "",
             f"`{rel}` (and its plot `{rel.replace('.json', '.png')}`): {len(r['rounds'])} round(s) of each arm, "
             f"{r['duration_s']:.0f} s of replay each, ShareGPT prompts then HumanEval's from {s:.0f} s, one request at "
             f"a time, never retried; serving engine on core(s) {r['serving_cores']}, the loop on {r['loop_cores']}; "
             f"served mean acceptance length from the serving engine's own counters over {r['window_s']:.0f}-s windows, "
             "weighted by drafts.", "",
             "| round | arm | requests | failed | tokens/s | MAL before the shift | MAL after the shift | swaps done / gated |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for rnd in r["rounds"]:
        for arm in ("static", "live"):
            a = rnd[arm]
            lines.append(f"| {rnd['round']} | {arm} | {a.get('requests')} | {len(a.get('failed') or [])} | "
                         f"{_f(a.get('tokens_per_s'), 2)} | {_f(mal(a, s, False))} | {_f(mal(a, s, True))} | "
                         f"{_swaps(a) if arm == 'live' else '–'} |")  # fmt: skip
    crossed = [rnd.get("live_crossed_static_after_shift_s") for rnd in r["rounds"]]
    last = min(120.0, r["duration_s"] - s)
    tail = "; ".join(f"round {rnd['round']}: live {_f(mal_last(rnd['live'], r['duration_s'], last))}, static "
                     f"{_f(mal_last(rnd['static'], r['duration_s'], last))}" for rnd in r["rounds"])  # fmt: skip
    swaps = swap_rows(r)
    if swaps:
        lines += ["", "Each gate decision of the live arms (the held-out acceptance of the live draft and of the "
                  "candidate, measured by the gate before the swap; gate and swap in seconds):", "",
                  "| round | versions | result | held-out prompts | live draft | candidate | gate s | swap s |",
                  "|---|---|---|---|---|---|---|---|", *swaps]  # fmt: skip
    lines += ["",
              f"Over the replay's last {last:.0f} s: {tail}.",
              "",
              f"After the shift: live {_f(sm['live']['mean_after_shift'])} against static {_f(sm['static']['mean_after_shift'])} "
              f"(live − static {_f(sm['live_minus_static_after_shift'])}; the static arm's spread over the rounds "
              f"{_f(sm['static']['spread_after_shift'])}). The issue's check, live above static by more than that spread: "
              f"**{ {True: 'met', False: 'not met', None: 'not decidable (one round)'}[sm['live_above_static_by_more_than_its_spread']] }**. "
              "When the live arm's windows stayed above the static arm's mean after the shift: "
              + ", ".join("never" if c is None else f"{c:.0f} s after it" for c in crossed) + " (per round). "
              f"Swaps done: {sm['swaps']} ({sm['swaps_refused_by_gate']} refused by the gate); failed client requests: "
              f"{sm['failed_requests']}; every arm's checks "
              f"(no failed request, no prompt sent twice, held-out slice disjoint from the teed samples): "
              f"{'all true' if sm['checks_all_true'] else 'not all true'}.", "", END]  # fmt: skip
    return "\n".join(lines)


def current_section(doc: str) -> str | None:
    if BEGIN not in doc or END not in doc:
        return None
    return doc[doc.index(BEGIN): doc.index(END) + len(END)]


def write_doc(doc_path: Path = ROOT / "docs" / "benchmarks.md") -> None:
    doc = doc_path.read_text()
    cur = current_section(doc)
    if cur is None:
        raise SystemExit(f"{doc_path}: no {BEGIN} … {END} markers")
    doc_path.write_text(doc.replace(cur, doc_section(load())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-doc", action="store_true", help="rewrite docs/benchmarks.md's section from the JSON")
    a = ap.parse_args(argv)
    if a.write_doc:
        write_doc()
    else:
        print(doc_section(load()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
