"""Shared fixtures. Integration tests start real processes; nothing here fakes vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Every vLLM the tests start serves in the checkpoint's own dtype (bf16), as their references are
# computed, whatever bf16 instructions the host has (the product serves float32 on a CPU without
# them: hsstream.launch.cpu_serving_dtype). A run may still set it.
os.environ.setdefault("HSSTREAM_VLLM_DTYPE", "auto")

# Every vLLM the tests start runs its model worker inside its engine-core process (vLLM's "uni"
# executor, what vLLM runs on one GPU by default; an offline ``LLM``, as in `hsstream eval`'s child,
# runs its engine core inside the calling process): one spawned process, ~8-15 s of imports here,
# less per engine start. The CPU build's
# own default, a worker process beside the engine core's, stays covered by the modules that ask for
# it with :data:`CPU_BUILD_EXECUTOR` (docs/testing.md lists them). A run may still set it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: The environment that gives a started vLLM the CPU build's default topology back (engine core and
#: worker in two processes), for the tests that prove the connector across that split.
CPU_BUILD_EXECUTOR = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}

#: The environment the session began with: what engines started ahead (tests/support/prestart.py)
#: start from, whatever a test running meanwhile has monkeypatched.
SESSION_ENV = dict(os.environ)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The deterministic tiny Qwen3 verifier, built offline (cached across runs)."""
    from hsstream.tiny_model import build_tiny_verifier

    return str(build_tiny_verifier())


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The real verifier, SmolLM2-135M-Instruct (bf16 from its Q4_1 GGUF): `hsstream models get
    smollm2`'s checkpoint, fetched, converted and checked once (a 93 MB download the first time,
    then cached in ~/.cache/hsstream). Only the tests that need a real model take it."""
    from hsstream.assets import get_model

    return str(get_model("smollm2"))


def _shm_files() -> set[str]:
    out = set()
    for root, _dirs, files in os.walk("/dev/shm"):
        out.update(os.path.join(root, f) for f in files if ".safetensors" in f)
    return out


def _shm_dirs() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("hsstream")} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(autouse=True)
def _no_spool_files_leak():
    """Every test leaves no hidden-state file behind in /dev/shm."""
    before = _shm_files()
    yield
    leaked = sorted(_shm_files() - before)
    assert not leaked, f"test leaked hidden-state files into /dev/shm: {_with_mtimes(leaked[:5])}"


def _with_mtimes(paths: list[str]) -> list[str]:
    """Each leaked file with its mtime: written before or after a restart is half the diagnosis."""
    out = []
    for p in paths:
        try:
            out.append(f"{p} (mtime {os.stat(p).st_mtime:.3f})")
        except FileNotFoundError:
            out.append(f"{p} (gone since)")
    return out


@pytest.fixture(scope="session", autouse=True)
def _no_spool_dirs_leak():
    """Spool directories made by fixtures are removed by the end of the session."""
    before = _shm_dirs()
    yield
    _close_prestarts()  # an engine started ahead and never taken holds a spool directory
    leaked = sorted(_shm_dirs() - before)
    assert not leaked, f"spool directories left in /dev/shm: {leaked}"


@pytest.fixture(scope="session", autouse=True)
def _no_orphaned_semaphores():
    """The semaphores of process groups the kill tests SIGKILLed are unlinked at the end
    (tests/support/semaphores.py says why they are left)."""
    from tests.support import semaphores

    before = semaphores.present()
    yield
    semaphores.remove_orphans(before)


_PRESTARTS = None  # tests.support.prestart.Prestarts of this run, if any module has a PRESTART
_MODULE_PLACE: dict[str, int] = {}


def pytest_collection_finish(session):
    """Plan the engines started one module ahead (tests/support/prestart.py), in run order."""
    global _PRESTARTS
    if os.environ.get("HSSTREAM_TEST_PRESTART", "1") == "0":
        return
    from tests.support.prestart import Entry, Prestarts

    entries = []
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is None or mod.__name__ in _MODULE_PLACE:
            continue
        _MODULE_PLACE[mod.__name__] = place = len(_MODULE_PLACE)
        for key, (start, stop) in getattr(mod, "PRESTART", {}).items():
            entries.append(Entry(f"{mod.__name__}::{key}", place, start, stop))
    if entries:
        _PRESTARTS = Prestarts(entries)


def pytest_runtest_call(item):
    if _PRESTARTS is not None and getattr(item, "module", None) is not None:
        _PRESTARTS.reached(_MODULE_PLACE.get(item.module.__name__, -1))


def prestarted(module: str, key: str):  # noqa: ANN201 - whatever the module's start returns
    """The engine ``module``'s ``PRESTART[key]`` starts: started ahead if it was, else now."""
    import sys

    start = sys.modules[module].PRESTART[key][0]
    return start() if _PRESTARTS is None else _PRESTARTS.take(f"{module}::{key}", start)


def _close_prestarts() -> None:
    if _PRESTARTS is not None:
        _PRESTARTS.close()


def pytest_sessionfinish(session):
    _close_prestarts()


def is_integration(path: Path) -> bool:
    """Whether a test file lies under ``tests/integration/`` (at any depth: tests/integration/<package>/)."""
    parts = Path(path).parts
    return any(parts[i : i + 2] == ("tests", "integration") for i in range(len(parts) - 1))


#: The marker of tests too long for ``make test`` (minutes of real-model training and serving):
#: they run only when ``-m`` names it (``make test-real``), never under ``pytest tests`` or ``-m integration``.
OPT_IN = "real_acceptance"


def pytest_collection_modifyitems(config, items):
    """Every test under ``tests/integration/`` is marked ``integration`` (they start vLLM and the
    sidecar, or need vLLM installed): ``-m "not integration"`` leaves them out
    (tests/unit/project/test_integration_marker.py checks it selects every test that starts vLLM).
    Tests marked :data:`OPT_IN` are deselected unless ``-m`` names that marker."""
    for item in items:
        if is_integration(item.path):
            item.add_marker(pytest.mark.integration)
    if OPT_IN not in (config.getoption("markexpr", "") or ""):
        left = [i for i in items if i.get_closest_marker(OPT_IN)]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [i for i in items if not i.get_closest_marker(OPT_IN)]
