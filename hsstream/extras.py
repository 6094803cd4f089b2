"""What a command needs of an extra: a missing package is one line naming the extra to install.

The base install (``pip install hidden-state-stream``) is the CLI shell and the contracts; each
role's packages come with its extra (``[server]``, ``[trainer]``, ``[cpu]``/``[gpu]``, ``[data]``…,
pyproject.toml). A command run without its extra would otherwise die in a traceback ending in
"No module named 'uvicorn'"; ``tests/unit/project/test_declared_imports.py`` requires such optional
imports to sit under a handler like this one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

DIST = "hidden-state-stream"


def install_hint(extra: str) -> str:
    return f"pip install '{DIST}[{extra}]'"


@contextlib.contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Imports under this block belong to ``extra``: an ImportError becomes one line and exit 2."""
    try:
        yield
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        print(f"error: {what} needs the '{extra}' extra ({missing} is not installed): {install_hint(extra)}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from e
