"""POSIX semaphores that a SIGKILLed process group leaves in /dev/shm.

vLLM starts its workers with multiprocessing's spawn context, whose named semaphores
(``/dev/shm/sem.mp-*``, 32 bytes each) are unlinked by multiprocessing's resource tracker when
their owner exits. The kill tests (``os.killpg(..., SIGKILL)`` of an engine's or a stack's whole
group) kill the tracker with its owner, so nothing unlinks them. ``hsstream up`` records and
removes what its own dead engines leave (``hsstream/up/shm_cleanup.py``); the tests that kill a
group themselves leave theirs to the harness: at the end of the session it unlinks those that
appeared during the run and that no live process maps, with the same rule as ``hsstream up``."""

from __future__ import annotations

import os
import subprocess
import sys

from hsstream.up import remove_shm_files

SHM = "/dev/shm"
PREFIX = "sem.mp-"


def present(shm: str = SHM) -> set[str]:
    """The multiprocessing semaphores in ``shm`` now, by file name."""
    try:
        return {n for n in os.listdir(shm) if n.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


def remove_orphans(before: set[str], shm: str = SHM) -> list[str]:
    """Unlink the semaphores that appeared since ``before`` and that no live process maps;
    return their names."""
    removed, _kept = remove_shm_files({os.path.join(shm, n) for n in present(shm) - before})
    return sorted(os.path.basename(p) for p in removed)


_HOLDER = """
import multiprocessing as mp, time
lock = mp.get_context("spawn").Lock()
print(lock._semlock.name, flush=True)
time.sleep(60)
"""


def start_holder() -> tuple[subprocess.Popen, str]:
    """A process group of its own that makes one semaphore the way vLLM's processes do
    (multiprocessing's spawn context, its resource tracker in the group) and holds it mapped
    until killed: (process, the semaphore's /dev/shm path)."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    return p, f"{SHM}/sem." + p.stdout.readline().strip().lstrip("/")
