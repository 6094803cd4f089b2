"""``-m integration`` selects every test that starts vLLM, and ``-m "not integration"`` none.

Which tests start vLLM is read from their sources (tests/support/vllm_starts.py: a module that uses
one of the helpers that start it, or runs ``hsstream eval``, which serves the draft on vLLM).
Selection is pytest's own: a copy of the test tree's layout (every test module at its path, each
with one empty test) is collected by pytest (in a process of its own) with ``tests/conftest.py``'s
marker hook, under ``-m integration`` and ``-m "not integration"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.vllm_starts import starts_vllm

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[3]
TESTS = ROOT / "tests"


def all_test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py"))


def selected(pytester: pytest.Pytester, modules: list[Path], expr: str) -> set[str]:
    """The modules (paths relative to the root) whose test ``-m expr`` selects, pytest collecting
    a copy of their layout with the real marker hook."""
    for m in modules:
        rel = m.relative_to(ROOT)
        d = pytester.path / rel.parent
        d.mkdir(parents=True, exist_ok=True)
        for parent in [d, *d.parents]:  # the real tree's packages, so module names stay unique
            if parent == pytester.path:
                break
            if (ROOT / parent.relative_to(pytester.path) / "__init__.py").exists():
                (parent / "__init__.py").touch()
        (pytester.path / rel).write_text("def test_it():\n    pass\n")
    # The real hook, loaded from its file: this copy's own ``tests`` package has no conftest.
    (pytester.path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('real_tests_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "real = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(real)\n"
        "pytest_collection_modifyitems = real.pytest_collection_modifyitems\n")  # fmt: skip
    # A process of its own: the copy's modules have the real ones' names.
    r = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-m", expr,
                                      "-o", "markers=integration: x", "-o", "addopts=")  # fmt: skip
    return {line.split("::")[0] for line in r.outlines if "::test_it" in line}


def test_the_integration_marker_selects_exactly_the_integration_folder_and_every_vllm_start(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # collecting needs none of the installed plug-ins
    mods = all_test_modules()
    vllm = {str(m.relative_to(ROOT)) for m in mods if starts_vllm(m)}
    assert len(vllm) >= 10, f"the detector finds too few modules that start vLLM: {sorted(vllm)}"
    marked = selected(pytester, mods, "integration")
    unmarked = selected(pytester, mods, "not integration")
    assert marked | unmarked == {str(m.relative_to(ROOT)) for m in mods} and not marked & unmarked
    assert vllm <= marked, f"start vLLM but not selected by -m integration: {sorted(vllm - marked)}"
    assert not vllm & unmarked, f"start vLLM and run under -m 'not integration': {sorted(vllm & unmarked)}"
    assert marked == {str(m.relative_to(ROOT)) for m in mods if "integration" in m.relative_to(TESTS).parts[:1]}


def test_the_detector_sees_each_way_a_test_starts_vllm(tmp_path):
    cases = {
        "fixture.py": "def stack():\n    return prestarted(__name__, 'stack')\n",
        "stack.py": "from hsstream.devstack import Stack\n",
        "plain.py": "from tests.integration.trainer_client.test_dropin_clients import PlainVllm\n",
        "eval.py": "def test_e():\n    hsstream('eval', '--draft', 'd')\n",
        "cmd.py": "import sys\nCMD = [sys.executable, '-m', 'hsstream', 'eval']\n",
        "proxy.py": "from hsstream.proxy.engines import EngineManager\n",
        "none.py": "def test_n(tmp_path):\n    hsstream('up', '--dry-run')\n    stack = 1\n",
    }
    got = {}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        got[name] = starts_vllm(tmp_path / name)
    assert got == {"fixture.py": True, "stack.py": True, "plain.py": True, "eval.py": True, "cmd.py": True,
                   "proxy.py": True, "none.py": False}
