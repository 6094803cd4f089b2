"""docs/benchmarks.md's headline section (ours beside speculators' own pipeline) against
``bench/results/vs_speculators_cpu.json``.

The section between the markers must be exactly what ``python -m bench.vs_speculators
--write-doc`` writes from the JSON, whatever the outcome (checks failing, ours behind): every
figure comes from the JSON. Without the JSON, the section must say that the full run has not
been made, and quote no figure. A JSON from a ``--quick`` or ``--reduced`` run never stands
for the headline.
"""

from __future__ import annotations

from pathlib import Path

from bench.vs_speculators import results as R

ROOT = Path(__file__).resolve().parents[3]
RESULT = ROOT / "bench/results/vs_speculators_cpu.json"
REL = "bench/results/vs_speculators_cpu.json"


def test_the_headline_section_is_the_json_or_says_there_is_none():
    doc = (ROOT / "docs/benchmarks.md").read_text()
    section = R.current_section(doc)
    assert section is not None, "docs/benchmarks.md lost its vs-speculators section markers"
    r = R.load(RESULT)
    if r is not None:
        # the full size, or a size given on the command line (the JSON names it): never a smoke run
        assert r.get("mode") in ("full", "custom"), f"{REL} is a {r.get('mode')} run: only a full-size run is the headline"
    expected = R.doc_section(r, REL)
    assert section == expected, ("docs/benchmarks.md's vs-speculators section differs from what the JSON says: "
                                 "run `python -m bench.vs_speculators --write-doc`")  # fmt: skip
    if r is None:
        assert R.NOT_RUN in section and not any(ch.isdigit() for ch in section.replace(REL, "")), section


def test_the_section_check_catches_a_figure_edited_by_hand(tmp_path):
    """The comparison above can fail: a hand-edited figure or a stale table differs from the JSON's."""
    from tests.unit.bench.test_vs_speculators import result

    r = result()
    good = R.doc_section(r, REL)
    assert good != good.replace("1.700", "1.800")
    r2 = result()
    r2["arms"]["ours"]["curve"][-1]["T0"]["mean_acceptance_length"] = 1.71
    r2["comparison"] = R.comparison(r2)
    assert R.doc_section(r2, REL) != good
    assert R.doc_section(None, REL) != good
