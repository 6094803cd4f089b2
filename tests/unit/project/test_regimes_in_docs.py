"""docs/benchmarks.md's online-vs-offline regimes table against ``bench/results/online_vs_offline_<regime>_cpu.json``.

Whatever a regime's outcome (online ahead or behind), the row must say what its JSON says; a row
for a regime without a JSON fails, a JSON without a row fails, and a regime with neither is
reported as skipped (not run yet: ``make online-vs-offline REGIME=<regime>``), never passed.

The table (under a heading "Online vs offline: regimes"), one row per offline/online pair, the
first cell naming the JSON and the pair's online arm as ``regime/arm``:

| pair | offline final | online final | online saves | final T=0 offline / online | final T=1 offline / online | checks |
|---|---|---|---|---|---|---|
| `disk_limited/online` | 120 s | 80 s | 40.0 s | 0.812 / 0.820 | 0.451 / 0.460 | all pass |

(wall-clock seconds as the JSON rounds them, acceptance to 3 decimals; "checks": ``all pass``, or
``fail:`` and the names of the failing checks.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.online_vs_offline.ovo_regimes import REGIMES

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench/results"
HEADING = "Online vs offline: regimes"


def result_path(regime: str) -> Path:
    return RESULTS / f"online_vs_offline_{regime}_cpu.json"


def regime_rows(readme: str) -> dict[str, list[str]]:
    """``{"regime/arm": cells}`` of the regimes table ({} when the doc has no such section)."""
    m = re.search(rf"^#+ {re.escape(HEADING)}\n(.*?)(?=^#+ |\Z)", readme, re.M | re.S)
    if not m:
        return {}
    rows = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        key = re.fullmatch(r"`([a-z_]+/[a-z0-9_]+)`", cells[0]) if cells else None
        if key:
            rows[key.group(1)] = cells[1:]
    return rows


def expected_cells(result: dict, arm: str) -> list[str]:
    """The row the doc must show for the pair whose online arm is ``arm``."""
    pair = result["comparison"]["by_pair"][arm]
    off, on = pair["final"][pair["offline"]], pair["final"][arm]
    failing = [k for k, ok in result["checks"].items() if not ok]
    return [
        f"{off['wall_s']:g} s",
        f"{on['wall_s']:g} s",
        f"{pair['online_wall_s_saved_vs_offline']:.1f} s",
        f"{off['T0']:.3f} / {on['T0']:.3f}",
        f"{off['T1']:.3f} / {on['T1']:.3f}",
        "all pass" if not failing else "fail: " + ", ".join(failing),
    ]


def problems(readme: str, results: dict[str, dict | None]) -> tuple[list[str], list[str]]:
    """(what is wrong, which regimes have no result yet) for a doc and the regimes' JSONs
    (None: that regime's file is absent)."""
    rows = regime_rows(readme)
    wrong, missing = [], []
    for key in rows:
        regime = key.split("/")[0]
        if regime not in results:
            wrong.append(f"row {key!r}: no such regime")
        elif results[regime] is None:
            wrong.append(f"the doc quotes {key!r} but {result_path(regime).name} does not exist")
    for regime, result in results.items():
        if result is None:
            missing.append(regime)
            continue
        for arm in result["comparison"]["by_pair"]:
            key = f"{regime}/{arm}"
            if key not in rows:
                wrong.append(f"{result_path(regime).name} has pair {arm!r}, the doc's regimes table no row {key!r}")
            elif rows[key][:6] != (want := expected_cells(result, arm)):
                wrong.append(f"row {key!r}: {rows[key][:6]} but the JSON says {want}")
    return wrong, missing


def load(regime: str) -> dict | None:
    p = result_path(regime)
    return json.loads(p.read_text()) if p.exists() else None


@pytest.mark.parametrize("regime", REGIMES)
def test_each_regimes_row_says_what_its_json_says(regime):
    readme = (ROOT / "docs" / "benchmarks.md").read_text()
    wrong, missing = problems(readme, {r: load(r) for r in REGIMES})
    mine = [w for w in wrong if regime in w]
    assert not mine, "\n".join(mine)
    if regime in missing:
        pytest.skip(f"{result_path(regime).name} absent: not run yet (make online-vs-offline REGIME={regime})")


# ------------------------------------------------------------------ the check itself, on made-up inputs

RESULT = {
    "comparison": {"by_pair": {"online": {"offline": "offline", "online_wall_s_saved_vs_offline": -4.5,
                                          "final": {"offline": {"wall_s": 80.2, "T0": 0.8123, "T1": 0.45},
                                                    "online": {"wall_s": 84.7, "T0": 0.8, "T1": 0.4444}}}}},
    "checks": {"a": True, "b": True},
}  # fmt: skip
ROW = "| `disk_limited/online` | 80.2 s | 84.7 s | -4.5 s | 0.812 / 0.800 | 0.450 / 0.444 | all pass |"


def readme_with(*rows: str) -> str:
    return f"# x\n\n## {HEADING}\n\n| pair | a | b | c | d | e | f |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"


def test_a_row_matching_its_json_passes_even_where_online_loses():
    assert problems(readme_with(ROW), {"disk_limited": RESULT, "balanced": None}) == ([], ["balanced"])


def test_a_moved_figure_a_failed_check_a_row_without_json_and_a_json_without_row_each_fail():
    moved = ROW.replace("0.812", "0.813")
    assert "JSON says" in problems(readme_with(moved), {"disk_limited": RESULT})[0][0]
    failed = {**RESULT, "checks": {"a": True, "b": False}}
    assert "fail: b" in problems(readme_with(ROW), {"disk_limited": failed})[0][0]
    (w,), _ = problems(readme_with(ROW), {"disk_limited": None})
    assert "does not exist" in w
    (w,), _ = problems(readme_with(), {"disk_limited": RESULT})
    assert "no row" in w
    assert problems("# no table here\n", {"disk_limited": None}) == ([], ["disk_limited"])
