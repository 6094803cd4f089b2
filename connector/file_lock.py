"""The writer's half of the Example connector's lock-file contract (see ``protocol.LOCK_SUFFIX``).

Clients of vLLM's ``ExampleHiddenStatesConnector`` get the file's path in the response before
the file exists, and wait on ``<path>.lock``: vLLM's ``load_hidden_states`` takes a shared
flock (it sleeps while the writer holds the exclusive one), hs-connectors' ``FileTransfer``
polls for an exclusive one and then removes the lock. So the lock must exist, exclusively
held, before the path is returned, and only the writing process can hold it: vLLM's worker
(TP rank 0) creates it on the first step that schedules the request, which always precedes
the step whose output finishes the request. It is released (the descriptor closed) after
the atomic rename, and left for the reader to remove with the file, as the Example
connector does; when no file will come it is removed first, then released, so a waiting
reader wakes to a missing file instead of waiting forever, and nothing is left behind.
"""

from __future__ import annotations

import fcntl
import os

from connector import protocol as P

#: As the Example connector: readers open the lock read-write (hs-connectors) as the same user.
LOCK_MODE = 0o644


class LockError(OSError):
    pass


class WriteLock:
    def __init__(self, data_path: str | os.PathLike[str], *, make_dirs: bool = False) -> None:
        self.path = P.lock_path_for(data_path)
        if make_dirs:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, LOCK_MODE)
        except OSError as e:
            raise LockError(f"cannot create lock file {self.path}: {e.strerror}") from e
        try:
            # Never block the engine's step: a lock someone else holds is an error for this request.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise LockError(f"lock file {self.path} is held by another process ({e.strerror})") from e
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """The file is complete: wake readers; the lock file stays for them to remove."""
        self._close()

    def abandon(self) -> None:
        """No file will come: remove the lock file, then wake any reader already waiting."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
