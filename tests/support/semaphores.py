"""POSIX semaphores that a SIGKILLed process group leaves in /dev/shm.

vLLM starts its workers with multiprocessing's spawn context, whose named semaphores
(``/dev/shm/sem.mp-*``, 32 bytes each) are unlinked by multiprocessing's resource tracker when
their owner exits. The kill tests (``os.killpg(..., SIGKILL)`` of an engine's or a stack's whole
group) kill the tracker with its owner, so nothing unlinks them. They are not ours (``hsstream
up`` stops its children with SIGTERM first and leaves none), but a test run should not leave
them either: at the end of the session the harness unlinks those it saw appear that no live
process still maps."""

from __future__ import annotations

import contextlib
import os

SHM = "/dev/shm"
PREFIX = "sem.mp-"


def present(shm: str = SHM) -> set[str]:
    """The multiprocessing semaphores in ``shm`` now, by file name."""
    try:
        return {n for n in os.listdir(shm) if n.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


def mapped(shm: str = SHM) -> set[str]:
    """The names of those semaphores some live process maps. A semaphore in use is mapped by
    every process that opened it, but /proc/<pid>/maps may name it by the temporary file glibc
    created it as (``sem.XXXXXX (deleted)``), so they are matched by inode, not by name."""
    inodes: dict[int, str] = {}
    for name in present(shm):
        with contextlib.suppress(FileNotFoundError):
            inodes[os.stat(os.path.join(shm, name)).st_ino] = name
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if f" {shm}/" in line and (name := inodes.get(int(line.split(None, 5)[4]))) is not None:
                        out.add(name)
        except (OSError, IndexError, ValueError):  # the process went, or its maps are not ours to read
            continue
    return out


def remove_orphans(before: set[str], shm: str = SHM) -> list[str]:
    """Unlink the semaphores that appeared since ``before`` and that no live process maps;
    return their names."""
    gone = sorted(present(shm) - before - mapped(shm))
    for name in gone:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm, name))
    return gone
