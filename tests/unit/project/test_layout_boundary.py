"""The spool-layout seam (issue 42, deliverable 3): outside ``connector/layouts/``, only its
registry (``connector/layouts/__init__.py``, part of the package) and the settings
(``connector/contract/settings.py``) may import a layout module or name a layout's internals.

* A *layout module* is every module of the package but its registry (``connector.layouts.files``,
  ``connector.layouts.arena``, and any added beside them), and every module the registry names.
* A layout's *internals* are the names a layout module defines at its top level: its classes
  and functions (the halves, the arena's ``MappedArena``, ``check_slot_notice``…) and its
  upper-case constants. A module-level logger or an imported name is not one.
* *Naming* one is any identifier in the code (a name, an attribute, an imported name), lazy
  imports and ``TYPE_CHECKING`` blocks included; the registry's strings are not identifiers.

The product (``connector``, ``server``, ``trainer_client``, ``hsstream``) is checked; tests and
benchmarks may reach into a layout (they test it, or register their own).
"""

from __future__ import annotations

import ast
from pathlib import Path

from connector import layouts as L

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("connector", "server", "trainer_client", "hsstream")
PACKAGE = ROOT / "connector" / "layouts"
ALLOWED = {"connector/contract/settings.py"}


def layout_modules() -> set[str]:
    mods = {f"connector.layouts.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return mods | {lay.module for lay in L.REGISTRY.values()}


def internals(module: str) -> set[str]:
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name) and t.id.isupper():
                    out.add(t.id)
    return out


def violations(path: Path, mods: set[str], names: dict[str, str]) -> list[str]:
    """What ``path`` imports of a layout module, and which layout internals it names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if any(a.name == m or a.name.startswith(m + ".") for m in mods)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in mods or any(node.module.startswith(m + ".") for m in mods):
                found.append(f"from {node.module} import …")
            found += [f"from {node.module} import {a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
            found += [f"imports {a.name} ({names[a.name]})" for a in node.names if a.name in names]
        elif isinstance(node, ast.Name) and node.id in names:
            found.append(f"names {node.id} ({names[node.id]})")
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"names .{node.attr} ({names[node.attr]})")
    return sorted(set(found))


def test_only_the_registry_and_the_settings_reach_into_a_layout():
    mods = layout_modules()
    assert {"connector.layouts.files", "connector.layouts.arena"} <= mods
    names = {n: m for m in sorted(mods) for n in internals(m)}
    assert {"ArenaSidecar", "ArenaWriter", "ArenaReader", "MappedArena", "FilesWriter"} <= set(names)
    bad = {}
    for pkg in PRODUCT:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel.startswith("connector/layouts/") or rel in ALLOWED:
                continue
            if v := violations(p, mods, names):
                bad[rel] = v
    assert bad == {}, f"outside connector/layouts/, only its registry may reach a layout: {bad}"


def test_the_check_sees_an_import_and_a_name(tmp_path):
    """The check itself: a lazy import of a layout module and a layout's class named through the
    package are both seen (the planted violation, kept as a test of the test)."""
    p = tmp_path / "planted.py"
    p.write_text("def f():\n    from connector.layouts import arena\n    return arena.MappedArena\n")
    mods = layout_modules()
    names = {n: m for m in sorted(mods) for n in internals(m)}
    assert violations(p, mods, names) == ["from connector.layouts import arena",
                                          "names .MappedArena (connector.layouts.arena)"]  # fmt: skip
