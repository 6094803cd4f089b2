"""Which test modules start vLLM, read from their sources (no import, no collection).

Used by the integration marker's test (tests/unit/project/test_integration_marker.py: every module
that starts vLLM is selected by ``-m integration``) and by ``make test``'s runner (tests/run.py: the
integration modules that start none run beside the unit suite).
"""

from __future__ import annotations

import ast
from pathlib import Path

#: Names whose use starts vLLM: ``hsstream.devstack.Stack`` (vLLM + sidecar), the integration
#: fixtures built on it (``start_stack``; ``prestarted``, what a module's ``PRESTART`` starts),
#: the drop-in tests' ``PlainVllm`` (vLLM alone, ``launch.spawn`` of ``launch.vllm_args``),
#: ``test_up.Up`` (``hsstream up`` until "stack ready") and the proxy's ``EngineManager`` (its
#: managed serving engines). Not seen: the opt-in ``test_real_acceptance`` (``make demo``'s script
#: in a subprocess), deselected unless ``-m real_acceptance`` names it.
STARTERS = frozenset({"Stack", "start_stack", "prestarted", "PlainVllm", "Up", "EngineManager"})
#: ``hsstream eval``: serves the verifier with and without the draft on vLLM.
EVAL = ("hsstream", "eval")


def starts_vllm(path: Path) -> bool:
    """Whether the module uses a :data:`STARTERS` name (a name, an attribute, a fixture
    parameter or an import) or runs ``hsstream eval`` (``hsstream("eval", …)`` or a command
    list with ``"hsstream", "eval"``)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name) and node.id in STARTERS:
            return True
        if isinstance(node, ast.Attribute) and node.attr in STARTERS:
            return True
        if isinstance(node, ast.arg) and node.arg in STARTERS:
            return True
        if isinstance(node, ast.ImportFrom) and any(a.name in STARTERS for a in node.names):
            return True
        if isinstance(node, ast.Call):
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            fn = node.func.id if isinstance(node.func, ast.Name) else ""
            if fn == EVAL[0] and tuple(args[:1]) == EVAL[1:]:
                return True
        if isinstance(node, ast.List):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if any(tuple(items[i : i + 2]) == EVAL for i in range(len(items) - 1)):
                return True
    return False
