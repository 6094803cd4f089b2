"""The trainer side installs without vLLM or FastAPI: its imports must not reach them."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCK = "import sys\nfor m in ('vllm', 'fastapi', 'uvicorn', 'transformers'):\n    sys.modules[m] = None\n"


@pytest.mark.parametrize(
    "modules",
    [
        "connector.protocol, connector.settings, connector.layers",
        "trainer_client",
        "trainer_client.stream",
        "connector.transport, connector.transport.spool, connector.transport.zmq_bytes, connector.transport.mooncake",
        "connector.sample_tokens",  # the masks' code: transformers only when a tokenizer is loaded
        "hsstream.data_sources, hsstream.rest_client",  # the readers `hsstream train --submit` uses too
    ],
)
def test_imports_without_vllm_or_fastapi(modules):
    code = BLOCK + f"import {modules}\nprint('ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_only_the_plugin_module_imports_vllm():
    """connector/'s other modules are importable with vLLM blocked; the plug-in is not."""
    code = BLOCK + "import connector.worker_side, connector.scheduler_side, connector.spool_writer\n"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
    code = BLOCK + "import connector.vllm_plugin\n"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "vllm" in p.stderr


def test_the_data_sources_reader_imports_nothing_of_the_sidecar():
    code = ("import sys\nsys.modules['server'] = None\nimport hsstream.data_sources, hsstream.rest_client\n"
            "print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in ('server', 'pyarrow', 'datasets')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr[-2000:]  # pyarrow / datasets: when used


def _imports(path):  # noqa: ANN001, ANN202
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_the_generic_trainer_imports_no_draft_by_name():
    """trainer_client/train/ knows no algorithm: drafts come from the registry by the run's name,
    never from an import of trainer_client.drafts.<draft> or of speculators' models."""
    from pathlib import Path

    import trainer_client.drafts as D

    root = Path(__file__).resolve().parents[2] / "trainer_client" / "train"
    drafts = {m.split(":")[0] for m in D.REGISTRY.values()}
    bad = {}
    for f in sorted(root.glob("*.py")):
        hits = [m for m in _imports(f) if m in drafts or any(m.startswith(d + ".") for d in drafts)
                or m.startswith("speculators.models") or m.startswith("trainer_client.eagle3")]  # fmt: skip
        if hits:
            bad[f.name] = hits
    assert not bad, bad
    code = ("import sys\nimport trainer_client.train.trainer, trainer_client.train.run, trainer_client.train.step\n"
            "print(sorted(m for m in sys.modules if m.startswith('trainer_client.drafts.') and m != 'trainer_client.drafts.base'))")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr[-2000:])
