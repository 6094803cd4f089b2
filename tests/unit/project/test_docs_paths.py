"""Docs cite only what a reader of the repository has: no path on our own machines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").glob("*.md"))]
# Our machines' folders: the team's notes (shared/), the checkout's parent, the local wheel folder.
OUTSIDE = re.compile(r"(/work/|(?<![\w/.-])\.\./shared\b|`shared/|(?<![\w/.-])shared/(gpu|notes|hooks)\b|/opt/wheels\b)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_doc_names_a_path_outside_the_repository(doc):
    hits = [f"{doc.name}:{i}: {line.strip()}" for i, line in enumerate(doc.read_text().splitlines(), 1)
            if OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


def _ignored_results() -> list[str]:
    """Files under bench/results that git ignores here (a fresh clone, CI's, will not have them)."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing can be ignored")
    out = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "bench/results"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [Path(line).name for line in out.splitlines() if line]


def _named_as(name: str) -> re.Pattern:
    """`name` as a test's f-string or a doc's `…suffix` may spell it: each digit run may be a `{field}`."""
    parts = [re.escape(p) if not p.isdigit() else rf"(?:{p}|\{{\w+\}})" for p in re.split(r"(\d+)", name) if p]
    return re.compile("".join(parts))


def test_no_result_a_doc_or_test_reads_is_ignored_by_git():
    """Stop 50's `make demo` logs were `*.log`, which .gitignore keeps out of bench/results: they passed here and
    CI's fresh clone lacked them. A result named by a doc or a test must be a file a clone gets."""
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in
             [*DOCS, *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "bench").rglob("*.py"))]}
    hits = []
    for name in _ignored_results():
        pattern = _named_as(name)
        for where, text in texts.items():
            suffixes = re.findall(r"…([\w.-]+)", text)
            if pattern.search(text) or any(name.endswith(s) and "." in s for s in suffixes):
                hits.append(f"{name} (ignored by .gitignore) is named in {where}")
    assert not hits, "\n".join(hits)
