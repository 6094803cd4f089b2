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


def test_the_ledger_imports_nothing_of_the_sidecar_but_itself():
    """The ledger is the sidecar's state, below its threads and its HTTP layer: it imports
    none of them (nor FastAPI or ZeroMQ), only the shared contracts in connector/."""
    code = ("import sys\nfor m in ('fastapi', 'starlette', 'uvicorn', 'zmq', 'vllm'):\n    sys.modules[m] = None\n"
            "import server.ledger\n"
            "print(sorted(m for m, v in sys.modules.items() if v is not None and m.startswith('server.')\n"
            "             and not m.startswith('server.ledger')))")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout + p.stderr)[-2000:]
