"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def spool(tmp_path):
    """An empty spool directory (a real directory; /dev/shm is only needed for integration)."""
    d = tmp_path / "spool"
    d.mkdir()
    return d


@pytest.fixture
def up_spawns(monkeypatch) -> list[tuple[list[str], dict[str, str]]]:
    """What `hsstream up` would start, without starting it: each Popen's argv and env is recorded
    here and the call raises OSError("not starting anything in a unit test")."""
    from hsstream import up

    spawned: list[tuple[list[str], dict[str, str]]] = []

    class FakePopen:
        def __init__(self, args, **kw):  # noqa: ANN001, ANN003
            spawned.append((list(args), kw["env"]))
            raise OSError("not starting anything in a unit test")

    monkeypatch.setattr(up.subprocess, "Popen", FakePopen)
    return spawned
