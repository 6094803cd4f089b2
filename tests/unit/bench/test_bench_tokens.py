"""The benches talk to a devstack stack with that stack's token (the sidecar makes one by default,
in the stack's own run dir, which a plain ``SidecarClient(url)`` or a child ``hsstream train``
never looks in: it reads ``HSSTREAM_API_TOKEN`` or the default run dir, and gets 401).

Static, because the benches that do this start vLLM and run for many minutes outside ``make
test``: a call that passes a stack's bare URL where the stack is needed, or builds a client of a
stack's URL without its token, is found here instead of an hour into ``make vs-speculators``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _is_stack_api(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "api"


def violations(source: str, name: str = "<bench>") -> list[str]:
    """Where ``source`` hands a stack's bare ``.api`` URL to ``submit`` (bench/served_acceptance/acceptance.py's,
    which takes the stack) or to a ``SidecarClient`` without a ``token=``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        first = node.args[0] if node.args else None
        if fn == "submit" and first is not None and _is_stack_api(first):
            out.append(f"{name}:{node.lineno}: submit() takes the stack, not its URL")
        if fn == "SidecarClient" and first is not None and _is_stack_api(first):
            if not any(k.arg == "token" for k in node.keywords):
                out.append(f"{name}:{node.lineno}: SidecarClient of a stack's URL without its token (stack.client())")
    return out


def test_the_check_finds_a_bare_url_and_a_tokenless_client() -> None:
    bad = "submit(stack.api, rows, opts)\nwith SidecarClient(stack.api, timeout=3) as c: pass\n"
    good = "submit(stack, rows, opts)\nSidecarClient(stack.api, token=stack.token)\nstack.client(timeout=3)\n"
    assert len(violations(bad)) == 2
    assert violations(good) == []


def test_no_bench_reaches_a_stack_without_its_token() -> None:
    found = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        found += violations(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "\n".join(found)
