"""One sidecar per spool, ledger and socket.

A sidecar's start is not harmless to another one's: it recovers the ledger (moving samples
another sidecar has in flight), sweeps the spool of files no sample of *its* ledger names,
adopts or replaces the arena, and binds the ``ipc://`` sockets, which takes them over (ZeroMQ
unlinks a socket file and binds anew) and removes them when it exits. So before any of that the
sidecar takes an exclusive lock on each of them (:func:`acquire`): a ``flock`` on a lock file
beside each — ``<spool>/.hsstream-sidecar.lock``, ``<ledger>.lock``, ``<socket>.lock`` for each
``ipc://`` endpoint — which the kernel drops with the process, however it ends (kill -9
included), so a stale file never blocks a restart. A second sidecar on any of them stops with
the first one's pid and REST address, read from the lock file. ``hsstream serve`` also binds its
REST port before any of this, so a busy port is refused first (``hsstream/cli.py``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from connector.contract.settings import Settings
from connector.contract.spool import SIDECAR_LOCK

LEDGER_LOCK_SUFFIX = ".lock"
SOCKET_LOCK_SUFFIX = ".lock"


class AlreadyRunning(RuntimeError):
    """Another live sidecar holds one of this one's spool, ledger or sockets."""


def lock_files(s: Settings) -> list[tuple[str, Path]]:
    """(what it guards, the lock file) for each resource a sidecar of settings ``s`` takes."""
    out = [("spool", Path(s.spool_dir) / SIDECAR_LOCK),
           ("ledger", Path(str(s.ledger_file()) + LEDGER_LOCK_SUFFIX))]  # fmt: skip
    for what, ep in (("notice socket", s.notice_ep()), ("delivery socket", s.delivery_ep())):
        if ep.startswith("ipc://") and not ep.startswith("ipc://@"):  # an abstract socket has no file (refused anyway)
            out.append((what, Path(ep[len("ipc://") :] + SOCKET_LOCK_SUFFIX)))
    return out


@dataclass
class InstanceLock:
    """The locks this process holds; :meth:`release` (or the process's end) lets them go."""

    held: list[tuple[int, Path]] = field(default_factory=list)

    def release(self) -> None:
        for fd, path in self.held:
            try:
                os.unlink(path)  # removed while locked: a sidecar that opened it meanwhile tries again
            except OSError:
                pass
            os.close(fd)
        self.held = []


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its pid yet"


def _lock_one(what: str, path: Path) -> int:
    """The locked descriptor of ``path``. A holder removes its file as it lets go, so a file
    locked here that is no longer the one at ``path`` (removed between our open and our lock)
    is dropped and the new one tried."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise AlreadyRunning(
                f"another sidecar is running on this {what} ({holder}; lock {path}): stop it first, or give this "
                "one its own HSSTREAM_SPOOL_DIR, HSSTREAM_RUN_DIR and HSSTREAM_LEDGER_PATH"
            ) from None
        try:
            st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            return fd
        os.close(fd)


def acquire(s: Settings, *, rest: str | None = None) -> InstanceLock:
    """Lock every resource of ``lock_files(s)``, or none: :class:`AlreadyRunning` naming the
    holder. ``rest``: this sidecar's REST address, written into the lock files for the next one."""
    lock = InstanceLock()
    try:
        for what, path in lock_files(s):
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock.held.append((_lock_one(what, path), path))
        me = f"pid {os.getpid()}" + (f", REST {rest}" if rest else "") + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        for fd, _ in lock.held:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (me + "\n").encode(), 0)
    except BaseException:
        lock.release()
        raise
    return lock


def running_holder(s: Settings) -> str | None:
    """Who holds a lock of ``lock_files(s)`` now (its pid and REST address), if anyone: to name
    the sidecar already serving when this one's port is taken."""
    for _what, path in lock_files(s):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd)
        finally:
            os.close(fd)  # a shared lock taken here goes with it
    return None


def bind_rest(host: str, port: int, s: Settings) -> socket.socket:
    """The REST API's listening socket, bound before the sidecar touches anything else, so a
    port in use stops it first, naming the sidecar on it when one of ours holds these settings'
    locks. ``AlreadyRunning`` when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        holder = running_holder(s)
        who = f"a sidecar of these settings runs there ({holder})" if holder else "by another process"
        raise AlreadyRunning(f"cannot serve the REST API on {host}:{port}: {e.strerror or e}; it is taken {who} "
                             "(set HSSTREAM_PORT / --port for a second sidecar)") from None  # fmt: skip
    return sock
