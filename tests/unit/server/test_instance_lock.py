"""One sidecar per spool, ledger and socket (issue 40, item 5): the locks ``create_app`` takes
before it touches anything, each one on its own (two real `hsstream serve` on one spool or one
port: tests/integration/server/test_request_gate.py)."""

from __future__ import annotations

import os

import pytest

from connector.contract.settings import Settings
from server.instance_lock import AlreadyRunning, acquire, lock_files


def _settings(tmp_path, **kw) -> Settings:
    base = {"spool_dir": tmp_path / "spool", "run_dir": tmp_path / "run", "ledger_path": tmp_path / "state/l.sqlite"}
    return Settings(**{**base, **kw})


@pytest.mark.parametrize("shared", ["spool_dir", "ledger_path", "run_dir"])
def test_a_second_sidecar_sharing_any_one_resource_is_refused_naming_the_first(tmp_path, shared):
    first = _settings(tmp_path)
    (tmp_path / "spool").mkdir()
    lock = acquire(first, rest="http://127.0.0.1:8100")
    try:
        other = {"spool_dir": tmp_path / "spool2", "run_dir": tmp_path / "run2", "ledger_path": tmp_path / "s2/l.sqlite"}
        other[shared] = getattr(first, shared)
        (tmp_path / "spool2").mkdir()
        with pytest.raises(AlreadyRunning, match=rf"pid {os.getpid()}, REST http://127.0.0.1:8100"):
            acquire(Settings(**other))
        assert not (tmp_path / "s2/l.sqlite").exists() and not (tmp_path / "s2/l.sqlite.lock").exists()
    finally:
        lock.release()
    assert all(not p.exists() for _, p in lock_files(first))  # let go: the files go too
    acquire(first).release()  # and the next one starts


def test_a_killed_sidecars_lock_does_not_block_the_next(tmp_path):
    """flock goes with its process (kill -9 included): a lock file left behind holds nothing."""
    import subprocess
    import sys

    s = _settings(tmp_path)
    (tmp_path / "spool").mkdir()
    code = ("import os, sys; from connector.contract.settings import Settings; from server.instance_lock import acquire; "
            f"acquire(Settings(spool_dir={str(s.spool_dir)!r}, run_dir={str(s.run_dir)!r}, "
            f"ledger_path={str(s.ledger_path)!r})); os.kill(os.getpid(), 9)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert p.returncode == -9, p.stderr
    assert all(p.exists() for _, p in lock_files(s))  # left behind by the kill
    acquire(s).release()
