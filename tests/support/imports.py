"""The product's imports as a graph, read from the sources: for the project's layering tests.

Every ``import`` and ``from … import`` counts wherever it is (module level, inside a function,
a method, a ``try``), except under ``if TYPE_CHECKING:`` (never run). A ``from a.b import c``
is an edge to the module ``a.b.c`` when there is one, else to ``a.b`` (its ``__init__``);
relative imports are resolved against the importing module's package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The product's packages (what a wheel installs); bench/, tests/ and deploy/ are not product.
PRODUCT = ("connector", "server", "trainer_client", "hsstream")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(packages: Iterable[str] = PRODUCT, root: Path = ROOT) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name -> file."""
    out = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            out[module_name(p, root)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_run(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that can run: ``if TYPE_CHECKING:`` bodies left out (their ``else:`` kept)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imported(path: Path, name: str, mods: Iterable[str]) -> list[tuple[str, int]]:
    """(each module of ``mods`` that ``path`` imports, the line): ``import a.b.c`` is ``a.b.c``
    (or its longest prefix in ``mods``); ``from a.b import c`` is the module ``a.b.c`` when there
    is one, else ``a.b`` (a name from it). Relative imports are resolved (``name``: the module's)."""
    known = set(mods)
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg else name.split(".")[:-1]

    def within(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    out = []
    for node in _walk_run(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(t, node.lineno) for a in node.names if (t := within(a.name))]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package[: len(package) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for a in node.names:
                full = f"{base}.{a.name}"
                t = full if full in known else within(base)
                if t:
                    out.append((t, node.lineno))
    return out


def graph(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module of ``mods`` it imports: the first line that does}."""
    g: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges: dict[str, int] = {}
        for target, line in sorted(imported(path, name, mods), key=lambda x: x[1]):
            if target != name:
                edges.setdefault(target, line)
        g[name] = edges
    return g


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles of ``g``: each strongly connected component of more than one module
    (Tarjan), as one shortest circle through its smallest member, e.g. ``[a, b, a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion as deep as the longest import chain (~120 modules)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(_shortest_circle(g, c) for c in comps)


def _shortest_circle(g: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, within the component."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp  # unreachable for a strongly connected component


def describe(g: dict[str, dict[str, int]], circle: list[str], mods: dict[str, Path], root: Path = ROOT) -> str:
    """``a (a.py:12) -> b (b.py:40) -> a``: each step with the line that imports the next."""
    steps = []
    for a, b in zip(circle, circle[1:]):
        steps.append(f"{a} ({mods[a].relative_to(root)}:{g[a][b]})")
    return " -> ".join([*steps, circle[-1]])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names(mods: dict[str, Path]) -> set[str]:
    """Every private name (``_x``, not a dunder) the modules define: module-level and class-level
    functions, classes and assignments, and attributes set on ``self`` / ``cls``."""
    out: set[str] = set()
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
    return {n for n in out if _private(n)}


def private_reaches(path: Path, product_privates: set[str], product: Iterable[str] = PRODUCT) -> list[tuple[int, str]]:
    """(line, what) for each place ``path`` reaches into a private member of the product: a
    private name or module imported from a product package, ``x._name`` on anything but
    ``self``/``cls`` where the product defines ``_name``, and ``getattr``/``setattr``/
    ``hasattr``/``monkeypatch.setattr`` with such a name as a string."""
    roots = tuple(product)
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in roots:
            mod_parts = (node.module or "").split(".")
            if any(_private(p) for p in mod_parts):
                out.append((node.lineno, f"from {node.module} import …"))
            out += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names
                    if a.name.split(".")[0] in roots and any(_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in product_privates:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("getattr", "setattr", "hasattr", "delattr"):
                for arg in node.args[1:2]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in product_privates:
                        out.append((node.lineno, f"{name}(…, {arg.value!r})"))
    return sorted(out)
