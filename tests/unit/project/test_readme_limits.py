"""README is a guide, not a notebook: at most 150 lines of at most 120 characters (issue 42).

Figures, test counts and version tables belong in docs/ (docs/benchmarks.md and the page they
concern), where the figure tests hold them to their result files.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_LINES, MAX_WIDTH = 150, 120


def problems(text: str) -> list[str]:
    lines = text.splitlines()
    out = [f"{len(lines)} lines (at most {MAX_LINES})"] if len(lines) > MAX_LINES else []
    out += [f"line {i}: {len(ln)} characters (at most {MAX_WIDTH})" for i, ln in enumerate(lines, 1) if len(ln) > MAX_WIDTH]
    return out


def test_readme_fits():
    assert problems((ROOT / "README.md").read_text(encoding="utf-8")) == []


def test_the_check_counts_characters_not_bytes_and_fails_one_over():
    assert problems("─" * 120 + "\n" * 149) == []  # box-drawing characters: 3 bytes each, one character
    assert problems("x\n" * 151) == ["151 lines (at most 150)"]
    assert problems("x" * 121) == ["line 1: 121 characters (at most 120)"]
