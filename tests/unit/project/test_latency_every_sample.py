"""docs/benchmarks.md's notice -> trainer GPU figures over every delivered sample, held to the
result files: each "all N samples of `FILE` (`config`, round R): p50 a / p99 b / max c ms" is the
JSON's ``latency_notice_to_gpu_ms.all``, every H200 run with a latency is quoted so at least once,
and the section's table gives each run's steady-state window beside it as the JSON has it."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
SHORT = "online_gpu_h200x1_shared"
PHRASE = re.compile(r"all ([\d,]+) samples of `([\w.]+\.json)`(?: \(`(\w+)`(?:, round (\d+))?\))?: "
                    r"p50 ([\d,.]+) / p99 ([\d,.]+) / max ([\d,.]+) ms")  # fmt: skip


def fmt(x: float) -> str:
    """How the page writes a latency: whole ms with thousands separators from 100 ms, else one decimal."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def file_of(name: str) -> Path:
    return RESULTS / (f"{SHORT}{name}" if name.startswith("_") else name)


def latency_runs(path: Path) -> list[dict]:
    return [r for r in json.loads(path.read_text()).get("runs", []) if r.get("latency_notice_to_gpu_ms")]


def the_run(name: str, config: str | None, rnd: str | None) -> dict:
    runs = latency_runs(file_of(name))
    hits = [r for r in runs if (config is None or r["config"] == config) and (rnd is None or r["round"] == int(rnd))]
    assert len(hits) == 1, f"`{name}` ({config}, round {rnd}) names {len(hits)} of its runs: name the config (and round)"
    return hits[0]


def test_every_all_samples_quote_is_its_json():
    text = " ".join(DOC.read_text().split())
    quotes = PHRASE.findall(text)
    assert len(quotes) >= 30, len(quotes)
    for n, name, config, rnd, p50, p99, mx in quotes:
        a = the_run(name, config or None, rnd or None)["latency_notice_to_gpu_ms"]["all"]
        want = (f"{a['n']:,}", fmt(a["p50"]), fmt(a["p99"]), fmt(a["max"]))
        assert (n, p50, p99, mx) == want, f"`{name}` {config}: the page says {(n, p50, p99, mx)}, the JSON {want}"


def test_every_gpu_run_with_a_latency_is_quoted_over_every_sample():
    text = " ".join(DOC.read_text().split())
    quoted = {(str(file_of(name)), the_run(name, c or None, r or None)["config"], the_run(name, c or None, r or None)["round"])
              for _, name, c, r, *_ in PHRASE.findall(text)}  # fmt: skip
    want = {(str(p), r["config"], r["round"]) for p in sorted(RESULTS.glob("online_gpu_h[12]00*.json"))
            for r in latency_runs(p)}  # fmt: skip
    assert want - quoted == set(), f"runs whose latency over every sample docs/benchmarks.md does not quote: {sorted(want - quoted)}"


def test_the_sections_table_gives_each_runs_window_beside_every_sample():
    text = DOC.read_text()
    section = text[text.index("### Latency over every sample") :]
    section = section[: section.index("\n### ", 10)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 28
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = PHRASE.search(cells[2])
        assert m, line
        r = the_run(m[2], m[3] or None, m[4] or None)
        lat = r["latency_notice_to_gpu_ms"]
        assert cells[0].startswith(f"`{r['config']}`"), line
        assert cells[1] == f"{fmt(lat['p50'])} / {fmt(lat['p99'])} / {fmt(lat['max'])} ms", line
