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
