"""One percentile for the benches (issue 42, item 5): the benches each had their own copy of the
same nearest-rank quantile (six, plus two of another convention), so a fix to one would have
left the others. ``bench/common/__init__.py`` holds them (``pctl``, ``rank_value``); a bench module that
sorts a list and indexes it by a fraction of its length is writing its own: this test finds it."""

from __future__ import annotations

import ast
from pathlib import Path

from bench.common import pctl, rank_value, window_bounds

ROOT = Path(__file__).resolve().parents[3]


def own_quantiles(src: str) -> list[str]:
    """Functions that call ``sorted`` and index with a fraction of a length (``len(...)`` times or
    floor-divided by something)."""
    out = []
    for fn in ast.walk(ast.parse(src)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        calls = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        indexed = any(isinstance(s, ast.Subscript) and not isinstance(s.slice, ast.Slice)
                      and any(isinstance(c, ast.Call) and getattr(c.func, "id", "") == "len" for c in ast.walk(s.slice))
                      and any(isinstance(b, ast.BinOp) and isinstance(b.op, (ast.Mult, ast.FloorDiv))
                              for b in ast.walk(s.slice))
                      for s in ast.walk(fn))  # fmt: skip
        if "sorted" in calls and indexed:
            out.append(fn.name)
    return out


def test_no_bench_writes_its_own_percentile():
    found = {str(p.relative_to(ROOT)): names for p in sorted((ROOT / "bench").rglob("*.py"))
             if p.name != "__init__.py" or p.parent != ROOT / "bench" / "common"
             if (names := own_quantiles(p.read_text()))}  # fmt: skip
    assert found == {}, f"use bench.common.pctl / bench.common.rank_value: {found}"


def test_the_finder_finds_a_copy():
    copy = "def q(xs, p):\n    s = sorted(xs)\n    return s[min(len(s) - 1, int(p * len(s)))]\n"
    assert own_quantiles(copy) == ["q"] and own_quantiles("def f(xs):\n    return sorted(xs)[0]\n") == []
    assert own_quantiles("def m(xs):\n    s = sorted(xs)\n    return s[len(s) // 2]\n") == ["m"]
    assert own_quantiles("def f(xs):\n    s = sorted(xs)\n    return s[min(len(s) - 1, 8)]\n") == []


def test_the_two_conventions():
    xs = [float(i) for i in range(1, 101)]  # 1..100
    assert pctl(xs, 0.5) == 51.0 and pctl(xs, 0.99) == 99.0 and pctl(xs, 1.0) == 100.0 and pctl([], 0.5) is None
    assert rank_value(xs, 0.5) == 51.0 and rank_value(xs, 0.99) == 100.0 and rank_value(xs, 1.0) == 100.0


def test_the_window_is_the_tenth_to_the_ninetieth_percentile_of_times():
    ts = [float(i) for i in range(101)]
    assert window_bounds(ts) == (10.0, 90.0) and window_bounds(list(reversed(ts)), 0.0, 1.0) == (0.0, 100.0)
