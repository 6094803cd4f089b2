"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def spool(tmp_path):
    """An empty spool directory (a real directory; /dev/shm is only needed for integration)."""
    d = tmp_path / "spool"
    d.mkdir()
    return d
