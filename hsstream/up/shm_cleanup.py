"""Shared memory a killed vLLM group leaves in /dev/shm: recorded while it lives, removed once it is gone.

Apart from the supervisor because it is the one part that deletes files it did not name:
it reads /proc only, removes only what is provably the group's, and nothing here starts or
stops a process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from stat import S_ISREG


def shm_snapshot() -> dict[str, int]:
    """The plain files in /dev/shm now, by path with their inode: taken before an engine starts,
    so that what was there already (same name and inode) is never counted as the engine's."""
    out: dict[str, int] = {}
    try:
        for e in os.scandir("/dev/shm"):
            try:
                if e.is_file(follow_symlinks=False):
                    out[e.path] = e.inode()
            except OSError:
                continue
    except OSError:
        pass
    return out


def _shm_dev() -> int | None:
    try:
        return os.stat("/dev/shm").st_dev
    except OSError:
        return None


def _maps_of(pid: str, shm_dev: int | None = None) -> list[tuple[int, str]]:
    """(inode, path) of each /dev/shm file mapped by process ``pid`` (empty if unreadable).

    Only files on this /dev/shm's filesystem (``shm_dev``, default: looked up): an inode number
    is unique within one filesystem only, and a process in another mount namespace (a
    container, a test's private tmpfs) maps its own /dev/shm, whose inodes collide with ours."""
    with open(f"/proc/{pid}/maps") as f:
        return parse_maps(f, _shm_dev() if shm_dev is None else shm_dev)


def parse_maps(lines: Iterable[str], shm_dev: int | None) -> list[tuple[int, str]]:
    """(inode, path) of the /dev/shm files in /proc/PID/maps ``lines`` on device ``shm_dev``."""
    out = []
    for line in lines:
        i = line.find("/dev/shm/")
        if i >= 0:
            path = line[i:].strip().removesuffix(" (deleted)")
            if os.path.dirname(path) != "/dev/shm":
                continue
            fields = line.split()
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            if shm_dev is not None and os.makedev(major, minor) != shm_dev:
                continue
            out.append((int(fields[4]), path))
    return out


def group_shm_files(pgid: int, existing: dict[str, int] | None = None) -> set[str]:
    """The /dev/shm files a process group made and has mapped (vLLM's queues between its
    processes, torch's shared tensors, multiprocessing's semaphores).

    vLLM removes them when it exits normally; after a SIGKILL or an OOM kill they stay, a few
    hundred MB of RAM each time. Recorded while the group lives, removed once it is gone, so
    only files that are provably the group's count: mapped by one of its processes, not in
    ``existing`` (``shm_snapshot()`` taken before it started: a file that was there is
    someone else's, which vLLM only mapped), plain files owned by this user. Removal checks
    again that no live process maps them (``remove_shm_files``).
    """
    existing = existing or {}
    uid = os.geteuid()
    # Resolved by inode, not by the name /proc shows: a named semaphore is made by glibc as a
    # temporary ``sem.XXXXXX``, mapped, linked to its final name (multiprocessing's spawn
    # context, which vLLM uses, names them ``sem.mp-*``) and the temporary unlinked, so /proc
    # shows ``sem.XXXXXX (deleted)``; only the inode leads to the file.
    names = {inode: path for path, inode in shm_snapshot().items()}
    dev = _shm_dev()
    out: set[str] = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pgid:  # fields after comm: state ppid pgrp
                continue
            for inode, _mapped_as in _maps_of(d, dev):
                path = names.get(inode)
                if path is None or existing.get(path) == inode or path in out:
                    continue
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if S_ISREG(st.st_mode) and st.st_uid == uid and st.st_ino == inode:
                    out.add(path)
        except (OSError, ValueError, IndexError):
            continue
    return out


def live_shm_inodes() -> set[int]:
    """The inodes of the /dev/shm files some live process maps (by inode: /proc may show a
    file under a name it no longer has, see ``group_shm_files``; on this /dev/shm only)."""
    live: set[int] = set()
    dev = _shm_dev()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                live.update(inode for inode, _path in _maps_of(d, dev))
            except (OSError, ValueError, IndexError):
                continue
    return live


def remove_shm_files(paths: set[str]) -> tuple[list[str], list[str]]:
    """Remove the recorded files of a dead group (``group_shm_files``) that no live process
    maps: (removed, kept because mapped). A file a process still maps is in use, whoever made it."""
    live = live_shm_inodes()
    removed, kept = [], []
    for path in sorted(paths):
        try:
            if os.lstat(path).st_ino in live:
                kept.append(path)
                continue
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # vLLM removed it itself
            pass
    return removed, kept
