"""The trainer side installs without vLLM or FastAPI: its imports must not reach them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BLOCK = "import sys\nfor m in ('vllm', 'fastapi', 'uvicorn', 'transformers'):\n    sys.modules[m] = None\n"


@pytest.mark.parametrize(
    "modules",
    [
        "connector.protocol, connector.contract.settings, connector.layers",
        "connector.contract.messages, connector.contract.sample_file, connector.contract.payload, connector.contract.spool",
        "trainer_client",
        "trainer_client.stream",
        "trainer_client.sample, trainer_client.sample_reader, trainer_client.sample_checks, trainer_client.device_copy",
        "connector.transport, connector.transport.spool, connector.transport.zmq_bytes, connector.transport.mooncake",
        "connector.contract.sample_tokens",  # the masks' code: transformers only when a tokenizer is loaded
        "trainer_client.data_sources, hsstream.rest_client",  # the readers `hsstream train --submit` uses too
    ],
)
def test_imports_without_vllm_or_fastapi(modules):
    code = BLOCK + f"import {modules}\nprint('ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_only_the_plugin_module_imports_vllm():
    """connector/'s other modules are importable with vLLM blocked; the plug-in is not."""
    code = BLOCK + "import connector.worker_side, connector.scheduler_side, connector.spool_writer, connector.step_metadata\n"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
    code = BLOCK + "import connector.vllm_plugin\n"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "vllm" in p.stderr


def test_the_data_sources_reader_imports_nothing_of_the_sidecar():
    code = ("import sys\nsys.modules['server'] = None\nimport trainer_client.data_sources, hsstream.rest_client\n"
            "print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in ('server', 'pyarrow', 'datasets')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr[-2000:]  # pyarrow / datasets: when used


def test_the_ledger_imports_nothing_of_the_sidecar_but_itself():
    """The ledger is the sidecar's state, below its threads and its HTTP layer: it imports
    none of them (nor FastAPI or ZeroMQ), only the shared contracts in connector/."""
    code = ("import sys\nfor m in ('fastapi', 'starlette', 'uvicorn', 'zmq', 'vllm'):\n    sys.modules[m] = None\n"
            "import server.ledger\n"
            "print(sorted(m for m, v in sys.modules.items() if v is not None and m.startswith('server.')\n"
            "             and not m.startswith('server.ledger')))")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout + p.stderr)[-2000:]


# -- layering, read from the sources (every import, lazy ones included) -------------------------

ROOT = Path(__file__).resolve().parents[3]
OURS = ("connector", "server", "trainer_client", "hsstream", "bench", "tests", "deploy")


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, at any depth (relative imports resolved to ours)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append("connector.contract" if "contract" in path.parts else "?relative")
            elif node.module:
                out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _ours(name: str) -> bool:
    return name.split(".")[0] in OURS or name == "?relative"


def test_contracts_import_nothing_of_ours_but_each_other():
    """``connector/contract/`` is the kernel every process imports: it may not reach into the
    plug-in, the sidecar, the trainer or the CLI (an import circle, or vLLM in the trainer)."""
    bad = {str(p.relative_to(ROOT)): [m for m in _imports(p) if _ours(m) and not m.startswith("connector.contract")]
           for p in sorted((ROOT / "connector" / "contract").glob("*.py"))}  # fmt: skip
    assert {k: v for k, v in bad.items() if v} == {}


def test_contracts_import_without_torch_vllm_or_fastapi():
    mods = ", ".join(f"connector.contract.{p.stem}" for p in sorted((ROOT / "connector" / "contract").glob("*.py"))
                     if p.stem != "__init__")  # fmt: skip
    code = BLOCK + f"sys.modules['torch'] = None\nimport {mods}\nprint('ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_the_trainer_never_imports_the_sidecar_or_the_cli():
    """trainer_client runs on trainer hosts without the sidecar or the CLI: not one import of
    ``server`` or ``hsstream``, lazy ones included."""
    found = {}
    for p in sorted((ROOT / "trainer_client").rglob("*.py")):
        up = sorted(m for m in _imports(p) if m.split(".")[0] in ("server", "hsstream"))
        if up:
            found[str(p.relative_to(ROOT))] = up
    assert found == {}, "trainer_client imports server or hsstream"


def test_the_generic_trainer_imports_no_draft_by_name():
    """trainer_client/train/ knows no algorithm: drafts come from the registry by the run's name,
    never from an import of trainer_client.drafts.<draft> or of speculators' models."""
    from pathlib import Path

    import trainer_client.drafts as D

    root = Path(__file__).resolve().parents[3] / "trainer_client" / "train"
    drafts = {m.split(":")[0] for m in D.REGISTRY.values()}
    bad = {}
    for f in sorted(root.glob("*.py")):
        hits = [m for m in _imports(f) if m in drafts or any(m.startswith(d + ".") for d in drafts)
                or m.startswith("speculators.models") or m.startswith("trainer_client.eagle3")]  # fmt: skip
        if hits:
            bad[f.name] = hits
    assert not bad, bad
    code = ("import sys\nimport trainer_client.train.trainer, trainer_client.train.run, trainer_client.train.step\n"
            "print(sorted(m for m in sys.modules if m.startswith('trainer_client.drafts.') and m not in ('trainer_client.drafts.base', 'trainer_client.drafts.options')))")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr[-2000:])


def test_the_product_never_imports_the_tests():
    """``tests/`` (its sample-file factory, the stack fixtures) is test support: no module of the
    product imports it, lazily or not, so a wheel or an image works without it (benchmarks may:
    bench/long_checks/compat_matrix.py runs the integration tests' own comparisons against each vLLM)."""
    found = {}
    for pkg in ("connector", "server", "trainer_client", "hsstream"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            up = sorted(m for m in _imports(p) if m.split(".")[0] == "tests")
            if up:
                found[str(p.relative_to(ROOT))] = up
    assert found == {}, f"the product imports test support: {found}"


def test_only_the_demo_imports_the_development_stack():
    """``hsstream/devstack.py`` (the stack on private paths and free ports) is for the demo, the
    integration tests and the benchmarks: nothing else of the product imports it, lazily or not
    (operators start the stack with ``hsstream up`` or compose)."""
    found = {}
    for pkg in ("connector", "server", "trainer_client", "hsstream"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            if p.relative_to(ROOT).as_posix() in ("hsstream/devstack.py", "hsstream/demo.py"):
                continue
            bad = sorted(m for m in _imports(p) if m == "hsstream.devstack" or m.startswith("hsstream.devstack."))
            if bad:
                found[str(p.relative_to(ROOT))] = bad
    assert found == {}, f"the product imports the development stack: {found}"


def test_the_parts_of_up_never_import_the_supervisor():
    """``hsstream/up/``'s configuration, children, shared-memory cleanup, port check and log
    filters are below the :class:`Supervisor` that combines them: none imports it, nor the
    package's facade (``hsstream.up``, which imports the supervisor), lazily or not."""
    found = {}
    for p in sorted((ROOT / "hsstream" / "up").glob("*.py")):
        if p.name in ("__init__.py", "supervisor.py"):
            continue
        bad = sorted(m for m in _imports(p) if m == "hsstream.up" or m.startswith("hsstream.up.supervisor")
                     or m == "hsstream.up.Supervisor")  # fmt: skip
        if bad:
            found[p.name] = bad
    assert found == {}, f"a part of hsstream/up imports the supervisor: {found}"


def test_the_parts_of_online_gpu_never_import_the_script_and_load_nothing_heavy():
    """``bench/online_gpu/online_gpu.py`` runs as ``__main__`` (the orchestrator, and each consumer child
    with ``--consumer``): a part importing it would load it a second time, so none does. And
    importing the script loads no torch, vLLM or stack code: the orchestrator holds no CUDA,
    each part imports those where it uses them."""
    found = {}
    for p in sorted((ROOT / "bench" / "online_gpu").glob("online_gpu_*.py")):
        bad = sorted(m for m in _imports(p) if m == "bench.online_gpu.online_gpu" or m == "online_gpu")
        if bad:
            found[p.name] = bad
    assert found == {}, f"a part of bench/online_gpu/online_gpu.py imports the script: {found}"
    heavy = ("torch", "vllm", "numpy", "httpx", "hsstream", "trainer_client", "connector", "server")
    code = (f"import sys, runpy\nsys.argv = ['online_gpu.py', '--help']\ntry:\n    runpy.run_path({str(ROOT / 'bench' / 'online_gpu' / 'online_gpu.py')!r}, run_name='__main__')\n"
            f"except SystemExit:\n    pass\nprint(sorted(m for m in {heavy!r} if m in sys.modules))")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    loaded = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-2000:]
    assert p.returncode == 0 and loaded == "[]", f"importing bench/online_gpu/online_gpu.py loads {loaded}"
