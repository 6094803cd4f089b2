"""docs/benchmarks.md's ShareGPT-as-shipped figures against the result file they quote
(``bench/results/sharegpt_submit_cpu.json``, from ``bench/costs/sharegpt_submit.py``): the client's RSS
per records read, the cut, and every record accounted for. A re-run without the doc (or the
other way round) fails here with the figure that moved."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs/benchmarks.md").read_text()
RESULT = json.loads((ROOT / "bench/results/sharegpt_submit_cpu.json").read_text())
TITLE = "ShareGPT V3 as shipped through `hsstream submit` (`bench/costs/sharegpt_submit.py`)"


def section() -> str:
    m = re.search(rf"^## {re.escape(TITLE)}\n(.*?)(?=^## |\Z)", DOC, re.M | re.S)
    assert m, f"docs/benchmarks.md has no section {TITLE!r}"
    return m.group(1)


def rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in text.splitlines()
            if ln.startswith("|") and not re.match(r"^\|[-| ]+\|$", ln)]  # fmt: skip


def num(cell: str) -> float:
    return float(cell.replace(",", "").replace("+", "").split()[0])


def test_the_run_passed_its_checks():
    assert RESULT["ok"] and all(RESULT["checks"].values()), RESULT["checks"]
    assert RESULT["rows_read"] == RESULT["file"]["complete_records"] == 17_671


def test_the_rss_table_is_the_files():
    table = rows(section())
    head = next(r for r in table if r[0] == "records read")
    rss = next(r for r in table if r[0].startswith("client RSS"))
    want = RESULT["client_rss_mib_at"]
    for cell, value in zip(head[1:-1], rss[1:-1], strict=True):
        assert num(value) == want[str(int(num(cell)))], cell
    assert head[-1] == "while the sidecar admits" and num(rss[-1]) == RESULT["client_rss_while_admitting_mib"]
    growth = RESULT["client_rss_mib_from_1000"]
    assert f"{growth['min']} to {growth['max']} MiB" in section() and f"+{growth['growth']} MiB" in section()


def test_every_record_is_accounted_for_as_the_file_says():
    got = {r[0]: num(r[1]) for r in rows(section()) if len(r) == 2 and r[1][:1].isdigit()}
    assert got.pop("records read (the cut reported)") == RESULT["rows_read"]
    assert got.pop("queued") == RESULT["queued"]
    assert got.pop("queued + skipped") == RESULT["queued"] + RESULT["skipped_total"] == RESULT["rows_read"]
    assert {k.removeprefix("skipped: "): int(v) for k, v in got.items() if k.startswith("skipped: ")} == RESULT["skipped"]
    assert {k.removeprefix("repaired: "): int(v) for k, v in got.items() if k.startswith("repaired: ")} == RESULT["repaired"]
    cut = RESULT["cut"]
    assert f"{cut['records']:,} complete records read; the partial record from byte {cut['offset']:,}" in section()
