"""docs/benchmarks.md's live-traffic section against ``bench/results/live_traffic_cpu.json``: the
text between the markers is exactly what ``python -m bench.live_traffic.report --write-doc``
writes from the JSON, whatever the outcome; without the JSON it says the study has not run and
quotes no figure."""

from __future__ import annotations

import copy
from pathlib import Path

from bench.live_traffic import report as R

ROOT = Path(__file__).resolve().parents[3]


def result() -> dict:
    """A two-round result of the study's shape (figures made up for the test)."""
    def arm(name: str, before: float, after: float) -> dict:
        ws = [{"t": t, "phase": "A" if t <= 180 else "B", "drafts": 10.0, "mean_acceptance_length": before if t <= 180 else after,
               "acceptance_rate": 0.1} for t in range(30, 541, 30)]  # fmt: skip
        return {"arm": name, "requests": 50, "failed": [], "windows": ws, "tokens_per_s": 4.5, "unique_prompts": True,
                "swaps": [{"result": "done"}, {"result": "refused_by_gate"}] if name == "live" else [],
                "checks": {"no_failed_request": True, "no_prompt_sent_twice": True, "held_out_disjoint_from_teed": True}}
    return {"shift_at_s": 180.0, "duration_s": 540.0, "window_s": 30.0, "serving_cores": "0", "loop_cores": "1",
            "rounds": [{"round": r, "static": arm("static", 1.2, 1.05 + 0.01 * r), "live": arm("live", 1.2, 1.2),
                        "live_crossed_static_after_shift_s": 120.0} for r in (1, 2)]}  # fmt: skip


def test_the_section_is_the_json_or_says_there_is_none():
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    section = R.current_section(doc)
    assert section is not None, "docs/benchmarks.md lost its live-traffic markers"
    r = R.load()
    assert section == R.doc_section(r), "run `python -m bench.live_traffic.report --write-doc`"
    if r is None:
        assert R.NOT_RUN in section and not any(ch.isdigit() for ch in section.replace(R.REL, ""))
    else:
        assert not r.get("quick"), "a --quick run never stands for the study"


def test_the_summary_and_its_check():
    r = result()
    sm = R.summary(r)
    assert sm["static"]["after_shift"] == [1.06, 1.07] and sm["static"]["spread_after_shift"] == 0.01
    assert sm["live_minus_static_after_shift"] == 0.135 and sm["live_above_static_by_more_than_its_spread"] is True
    assert sm["swaps"] == 2 and sm["swaps_refused_by_gate"] == 2 and sm["failed_requests"] == 0 and sm["checks_all_true"] is True
    worse = copy.deepcopy(r)
    for rnd in worse["rounds"]:
        for w in rnd["live"]["windows"]:
            if w["t"] > 180:
                w["mean_acceptance_length"] = 1.065
    assert R.summary(worse)["live_above_static_by_more_than_its_spread"] is False
    one = copy.deepcopy(r)
    one["rounds"] = one["rounds"][:1]
    assert R.summary(one)["live_above_static_by_more_than_its_spread"] is None


def test_a_figure_edited_by_hand_differs():
    r = result()
    good = R.doc_section(r)
    assert "| 1 | live | 50 | 0 | 4.50 | 1.200 | 1.200 | 1 / 2 |" in good and "**met**" in good
    r2 = copy.deepcopy(r)
    r2["rounds"][0]["live"]["failed"] = [{"status": 500}]
    assert R.doc_section(r2) != good and R.doc_section(None) != good


def test_the_last_windows_and_each_gate_decision_are_in_the_section():
    r = result()
    for rnd in r["rounds"]:
        for w in rnd["static"]["windows"]:
            if w["t"] > 420:  # the last 120 s of a 540-s replay
                w["mean_acceptance_length"] = 1.5
        rnd["live"]["swaps"] = [{"from": "D0", "to": "run-step9", "result": "refused_by_gate", "gate": {
            "prompts": 6, "live": 1.522, "new": 1.467, "seconds": 157.0}}]  # fmt: skip
    assert R.mal_last(r["rounds"][0]["static"], 540.0, 120.0) == 1.5
    assert R.mal_last(r["rounds"][0]["live"], 540.0, 120.0) == 1.2
    text = R.doc_section(r)
    assert "Over the replay's last 120 s: round 1: live 1.200, static 1.500; round 2: live 1.200, static 1.500." in text
    assert "| 1 | D0 → run-step9 | refused_by_gate | 6 | 1.522 | 1.467 | 157 | – |" in text
    assert "| 2 | D0 → run-step9 |" in text
