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
