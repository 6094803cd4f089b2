"""The harness's clean-up of semaphores left by SIGKILLed process groups (tests/support/
semaphores.py): a real process group makes one with multiprocessing's spawn context, as vLLM
does; while the group lives the clean-up leaves it, once the group is SIGKILLed it unlinks it,
and one that was there before is never touched."""

from __future__ import annotations

import os
import signal

from hsstream.up import live_shm_inodes
from tests.support import semaphores


def test_a_killed_groups_semaphore_is_unlinked_and_a_live_ones_is_not(tmp_path):
    before = semaphores.present()
    (kept := tmp_path / "sem.mp-before").write_bytes(b"x")  # stands for one there before: same rule
    p, path = semaphores.start_holder()
    name = os.path.basename(path)
    try:
        assert name in semaphores.present() and name not in before
        assert os.stat(f"/dev/shm/{name}").st_ino in live_shm_inodes()
        assert name not in semaphores.remove_orphans(before)  # alive: mapped, kept
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    assert os.path.exists(f"/dev/shm/{name}")  # the tracker died with the group: left behind
    assert name in semaphores.remove_orphans(before)
    assert not os.path.exists(f"/dev/shm/{name}")
    assert semaphores.remove_orphans({"sem.mp-before"}, shm=str(tmp_path)) == [] and kept.exists()
