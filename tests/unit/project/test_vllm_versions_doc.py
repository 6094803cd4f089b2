"""docs/vllm-versions.md tells the truth per vLLM release, and the ``gpu`` extra follows its rule:
every release 0.26–0.34 has a row saying how it was tested; an engine-run row is backed by a
passing engine run's result file, a "conformance only" row by a passing release in
bench/results/vllm_conformance.json; the extra admits exactly the releases the rule admits."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "vllm-versions.md"
RESULTS = ROOT / "bench" / "results"
RELEASES = [f"0.{m}" for m in range(26, 35)]


def matrix(text: str | None = None) -> dict[str, list[str]]:
    """The matrix's rows by each release named in the first cell ("0.27.0, 0.27.1, ..." → each)."""
    text = text if text is not None else DOC.read_text()
    body = text.split("## The matrix", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not re.match(r"^\d+\.\d+", cells[0]):
            continue
        for v in re.findall(r"\d+\.\d+\.\d+", cells[0]):
            rows[v] = cells
    return rows


def engine_passes() -> set[str]:
    rows = json.loads((RESULTS / "compat_matrix.json").read_text())["rows"]
    out = {r["version"].split()[0] for r in rows if r["pass"]}
    gpu = json.loads((RESULTS / "gpu_check_h200.json").read_text())
    if gpu.get("ok"):
        out.add(gpu["vllm"])
    return out


def conformance_passes() -> set[str]:
    doc = json.loads((RESULTS / "vllm_conformance.json").read_text())
    return {v["version"] for v in doc["versions"] if v["ok"]}


def admitted(rows: dict[str, list[str]]) -> set[str]:
    """The rule: an engine run passed, or the conformance target passed and the row says so."""
    engine, conf = engine_passes(), conformance_passes()
    return {v for v, cells in rows.items() if v in engine or (v in conf and "conformance only" in cells[1])}


def gpu_extra() -> tuple[str, str]:
    m = re.search(r'^gpu = \["vllm>=([\d.]+),<([\d.]+)"[,\]]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject's gpu extra is no longer vllm>=A,<B"
    return m.group(1), m.group(2)


def minor(v: str) -> tuple[int, int]:
    a, b = v.split(".")[:2]
    return int(a), int(b)


def check(rows: dict[str, list[str]], extra: tuple[str, str]) -> list[str]:
    problems = []
    for r in RELEASES:
        if not any(v.startswith(r + ".") for v in rows):
            problems.append(f"no row for vLLM {r}")
    engine, conf = engine_passes(), conformance_passes()
    for v, cells in rows.items():
        how = cells[1]
        if "engine run" in how and v not in engine:
            problems.append(f"{v}: says engine run, no passing engine run in its result files")
        if "conformance only" in how and v not in conf:
            problems.append(f"{v}: says conformance only, bench/results/vllm_conformance.json has no pass for it")
        if "engine run" not in how and "conformance only" not in how:
            problems.append(f"{v}: does not say how it was tested")
    ok = sorted({minor(v) for v in admitted(rows)})
    want = (f"{ok[0][0]}.{ok[0][1]}", f"{ok[-1][0]}.{ok[-1][1] + 1}")
    if extra != want or [m for m in range(ok[0][1], ok[-1][1] + 1) if (0, m) not in ok]:
        problems.append(f"the gpu extra is vllm>={extra[0]},<{extra[1]}; the rule admits {ok} (>={want[0]},<{want[1]})")
    return problems


def test_the_matrix_and_the_gpu_extra_follow_the_rule():
    assert check(matrix(), gpu_extra()) == []


def test_the_check_fails_on_a_row_or_an_extra_that_does_not():
    rows = matrix()
    assert check(rows, ("0.26", "0.36"))  # an extra wider than the rule
    assert check({k: v for k, v in rows.items() if not k.startswith("0.33")}, gpu_extra())  # a missing release
    lie = {**rows, "0.34.0": [rows["0.34.0"][0], "engine run on CUDA", *rows["0.34.0"][2:]]}
    assert any("no passing engine run" in p for p in check(lie, gpu_extra()))
