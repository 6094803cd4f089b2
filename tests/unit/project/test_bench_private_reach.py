"""``bench/`` uses the product as a user would: no reach into a private member (``_name``) of a
product module — no private name or module imported from connector, server, trainer_client or
hsstream, no ``obj._name`` (on anything but the bench's own ``self``/``cls``) where the product
defines ``_name``, no ``getattr(obj, "_name")``. A benchmark that needs something the product
keeps private asks the product for a public name (a refactor then breaks the benchmark's
import, not its figures, silently)."""

from __future__ import annotations

from pathlib import Path

from tests.support import imports as I


def reaches(root: Path, product_privates: set[str]) -> dict[str, list[tuple[int, str]]]:
    found = {}
    for p in sorted((root / "bench").rglob("*.py")):
        got = I.private_reaches(p, product_privates)
        if got:
            found[str(p.relative_to(root))] = got
    return found


def test_bench_reaches_into_no_private_member_of_the_product():
    found = reaches(I.ROOT, I.private_names(I.modules()))
    assert found == {}, f"bench/ reaches into private members of the product: {found}"


def test_the_check_sees_each_kind_of_reach(tmp_path):
    """The detector on a planted bench file, each kind of reach once, beside what is allowed."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "planted.py").write_text(
        "import os\n"
        "from connector.spool_writer import SpoolWriter, _helper\n"  # a private name imported
        "from connector._internal import x\n"  # a private module
        "import trainer_client._secret\n"  # a private module
        "class Bench:\n"
        "    def __init__(self):\n"
        "        self._lock = 1\n"  # the bench's own private: fine
        "    def run(self, w):\n"
        "        with w._lock:\n"  # the product's private attribute
        "            n = self._lock\n"
        "        getattr(w, '_pending')\n"  # the same, by name
        "        os._exit(0)\n"  # not the product's
        "        return w.__class__\n"  # a dunder: fine
    )  # fmt: skip
    found = reaches(tmp_path, {"_lock", "_pending", "_helper"})
    assert found == {"bench/planted.py": [
        (2, "from connector.spool_writer import _helper"), (3, "from connector._internal import …"),
        (4, "import trainer_client._secret"), (9, "w._lock"), (11, "getattr(…, '_pending')")]}, found
