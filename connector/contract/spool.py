"""The spool's rules: which names are ours, the marker that makes a directory a spool, how a
name is resolved, removed or retired, and the lock-file contract of vLLM's Example connector.

Every component that reads or deletes a spool file goes through here: a notice or a delivery
is input from another process, and must never make us touch anything else. The connector
writes only ``hs-…`` names (:func:`file_name_for_request`), under a hidden temporary name
first (:func:`tmp_name_for`); the sidecar, the trainer and ``hsstream up`` delete no other name,
and blind clean-ups run only in a marked spool (:func:`claim_spool`).

The lock (:class:`WriteLock` is the writer's half): clients of vLLM's
``ExampleHiddenStatesConnector`` get the file's path in the response before the file exists,
and wait on ``<path>.lock``: vLLM's ``load_hidden_states`` takes a shared flock (it sleeps
while the writer holds the exclusive one), hs-connectors' ``FileTransfer`` polls for an
exclusive one and then removes the lock. So the lock must exist, exclusively held, before the
path is returned, and only the writing process can hold it: vLLM's worker (TP rank 0) creates
it on the first step that schedules the request, which always precedes the step whose output
finishes the request. It is released (the descriptor closed) after the atomic rename, and left
for the reader to remove with the file, as the Example connector does; when no file will come
it is removed first, then released, so a waiting reader wakes to a missing file instead of
waiting forever, and nothing is left behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import stat
from pathlib import Path

from connector.contract.arena import ARENA_NAME
from connector.contract.errors import ProtocolError

FILE_SUFFIX = ".safetensors"
TMP_PREFIX = "."
TMP_SUFFIX = ".tmp"
#: Every spool file the connector writes is named ``hs-…`` (``file_name_for_request``): the
#: sidecar, the trainer and ``hsstream up`` delete no other name, whatever a message says.
FILE_PREFIX = "hs-"
#: Created by the sidecar in an empty or new spool directory: proof that the spool is ours.
#: Blind clean-ups (the reaper, ``hsstream up``'s stop) only ever run in a marked spool.
SPOOL_MARKER = ".hsstream-spool"
#: The running sidecar's lock in its spool (``server/instance_lock.py``): one sidecar per spool.
SIDECAR_LOCK = ".hsstream-sidecar.lock"
SPOOL_MODE = 0o700  # token ids are the users' prompts: only our user reads the spool
FILE_MODE = 0o600
#: A file's companion lock, ``<path>.lock`` (vLLM's Example-connector contract,
#: which its ``load_hidden_states`` and hs-connectors' ``FileTransfer`` wait on): it exists,
#: with an exclusive flock held by the writer, before the path is returned to the client;
#: the flock is released once the file is complete; the reader removes the lock with the file.
LOCK_SUFFIX = ".lock"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}\.safetensors$")


class UnsafePathError(ProtocolError):
    """A name that would reach outside the spool (``..``, absolute, symlink, odd characters)."""


class SpoolNotOurs(ProtocolError):
    """A spool directory we did not create (no marker, not empty): nothing in it is ours to delete."""


def file_name_for_request(request_id: str) -> str:
    """A spool file name derived from vLLM's request id (unique per engine), safe as a name,
    and recognisably ours (``FILE_PREFIX``)."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", request_id)[:160] or "request"
    if stem != request_id:  # keep distinct ids distinct after the substitution
        stem += "-" + hashlib.blake2s(request_id.encode(), digest_size=6).hexdigest()
    return FILE_PREFIX + stem + FILE_SUFFIX


_OWN_NAME = re.compile(r"^hs-[A-Za-z0-9_-]{1,200}\.safetensors$")
_OWN_TMP = re.compile(r"^\.(hs-[A-Za-z0-9_-]{1,200}\.safetensors)\.[0-9]{1,10}\.tmp$")
_OWN_LOCK = re.compile(r"^hs-[A-Za-z0-9_-]{1,200}\.safetensors\.lock$")


def is_own_name(name: str) -> bool:
    """True for a name the connector writes: a spool file, its temporary name or its lock."""
    return isinstance(name, str) and bool(
        _OWN_NAME.fullmatch(name) or _OWN_TMP.fullmatch(name) or _OWN_LOCK.fullmatch(name)
    )


def is_own_lock_name(name: str) -> bool:
    """The companion lock (``LOCK_SUFFIX``) of a spool file the connector writes."""
    return isinstance(name, str) and bool(_OWN_LOCK.fullmatch(name))


def lock_is_free(path: str | os.PathLike[str]) -> bool:
    """True if no writer holds the lock file's flock (the write is done or was abandoned).
    A lock still held belongs to a write in progress and must stay."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops our shared flock


def tmp_name_for(name: str) -> str:
    """Hidden name a file is written under before the atomic rename makes it visible."""
    return f"{TMP_PREFIX}{name}.{os.getpid()}{TMP_SUFFIX}"


def is_tmp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX)


def lock_path_for(path: str | os.PathLike[str]) -> str:
    """The companion lock of a hidden-state file (same directory, ``.lock`` appended)."""
    return os.fspath(path) + LOCK_SUFFIX


def is_lock_name(name: str) -> bool:
    """A spool name that is the companion lock of a hidden-state file."""
    return name.endswith(FILE_SUFFIX + LOCK_SUFFIX) and _SAFE_NAME.fullmatch(name[: -len(LOCK_SUFFIX)]) is not None


def data_name_of_lock(name: str) -> str:
    """The hidden-state file a lock belongs to (the lock's name without ``.lock``)."""
    if not is_lock_name(name):
        raise UnsafePathError(f"{name!r} is not a lock file name")
    return name[: -len(LOCK_SUFFIX)]


def resolve_in_spool(spool: str | os.PathLike[str], name: str, *, must_exist: bool = True) -> Path:
    """The path of ``name`` inside ``spool``, or ``UnsafePathError``.

    Every component that reads or deletes a spool file goes through here: a notice or a
    delivery is input from another process, and must never make us touch anything else.
    Only flat, plain names are allowed; a symlink is refused even if it points inside.
    """
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise UnsafePathError(f"refusing spool file name {name!r}: not a plain file name in the spool")
    root = Path(spool).resolve()
    path = root / name
    if path.parent != root:
        raise UnsafePathError(f"refusing {name!r}: outside the spool {root}")
    if must_exist:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"refusing {name!r}: not a regular file (symlink or special)")
    return path


def spool_file_exists(spool: str | os.PathLike[str], name: str | None) -> bool:
    """True if ``name`` is a plain file in the spool; any unsafe or missing name is False."""
    try:
        return name is not None and resolve_in_spool(spool, name).exists()
    except (UnsafePathError, FileNotFoundError):
        return False


def remove_from_spool(spool: str | os.PathLike[str], name: str | None) -> bool:
    """Delete ``name`` from the spool if it is a plain file there with a name the connector
    writes (``is_own_name``), with its companion lock if it has one; never anything else.
    Returns whether the file was removed (already gone, unsafe or not ours: False)."""
    path = _own_file_unlocked(spool, name)
    if path is None:
        return False
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def retire_from_spool(spool: str | os.PathLike[str], name: str | None) -> Path | None:
    """Take ``name`` out of the spool at once, for a slower delete elsewhere: its lock removed,
    the file renamed to a temporary name of ours (``tmp_name_for``), which is returned. Freeing
    a large tmpfs file takes milliseconds, the rename microseconds; for everyone else the file is
    gone, and if the delete never comes (a killed process) the reaper takes the temporary name
    as it takes a connector's. None: nothing of ours by that name (same rules as
    :func:`remove_from_spool`)."""
    path = _own_file_unlocked(spool, name)
    if path is None:
        return None
    dest = path.with_name(tmp_name_for(path.name))
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return None
    return dest


def _own_file_unlocked(spool: str | os.PathLike[str], name: str | None) -> Path | None:
    """The spool file ``name`` if it is one the connector writes (its companion lock removed
    now, as the file is about to go); None for any other name, an unsafe one or a missing file."""
    if not name or not _OWN_NAME.fullmatch(name):
        return None
    try:
        path = resolve_in_spool(spool, name)
    except (UnsafePathError, FileNotFoundError):
        return None
    _remove_lock_of(path)
    return path


def _remove_lock_of(path: Path) -> None:
    lock = Path(lock_path_for(path))
    try:
        if stat.S_ISREG(os.lstat(lock).st_mode):
            lock.unlink()
    except FileNotFoundError:
        pass


def is_marked_spool(spool: str | os.PathLike[str]) -> bool:
    """True if ``spool`` is a plain directory holding our marker as a plain file."""
    try:
        return stat.S_ISDIR(os.lstat(spool).st_mode) and stat.S_ISREG(os.lstat(Path(spool) / SPOOL_MARKER).st_mode)
    except FileNotFoundError:
        return False


def own_spool_entries(spool: str | os.PathLike[str]) -> list[str]:
    """Names in ``spool`` that are ours to delete: the connector's files and temporary files,
    the sidecar's arena (``arena.ARENA_NAME``, and one it was making) and its lock
    (:data:`SIDECAR_LOCK`, once the sidecar is gone), and only in a marked
    spool (an unmarked directory may be anything, e.g. a model folder)."""
    if not is_marked_spool(spool):
        return []

    def ours(name: str) -> bool:
        return (is_own_name(name) or name in (ARENA_NAME, SIDECAR_LOCK)
                or (name.startswith(ARENA_NAME + ".") and name.endswith(".new")))

    return [e.name for e in os.scandir(spool) if ours(e.name) and e.is_file(follow_symlinks=False)]


#: The spool's own files, kept by design once every sample is gone: its marker, the sidecar's
#: instance lock and its arena. Not "left behind".
KEPT_NAMES = (SPOOL_MARKER, SIDECAR_LOCK, ARENA_NAME)


def leftover_entries(spool: str | os.PathLike[str]) -> list[str]:
    """What a run left behind in ``spool``: the connector's sample and temporary files, not the
    spool's own (:data:`KEPT_NAMES`). Empty after every sample is consumed: what the benchmarks
    check "nothing leaked" by."""
    return [n for n in own_spool_entries(spool) if n not in KEPT_NAMES]


def claim_spool(spool: str | os.PathLike[str]) -> bool:
    """Make ``spool`` ours or refuse it: create it (mode 0700) with the marker if missing, mark
    it if empty, accept it if marked; refuse anything else (``SpoolNotOurs``), e.g. a model
    folder, so that no clean-up ever runs in it. Returns True if the marker was created now.

    The spool must be a plain directory (a symlink planted in the world-writable /dev/shm could
    point it elsewhere), belong to this user and not be group- or world-writable."""
    root = Path(spool)
    try:
        root.mkdir(parents=True, mode=SPOOL_MODE)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise SpoolNotOurs(f"spool {root} is not a plain directory (a symlink?): refusing to manage it")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SpoolNotOurs(
            f"spool {root} must belong to this user and not be group- or world-writable "
            f"(owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})"
        )
    if is_marked_spool(root):
        if st.st_mode & 0o077:  # ours (marked, our uid), but made before spools were private
            os.chmod(root, SPOOL_MODE)
        return False
    others = sorted(n for n in os.listdir(root) if n != SPOOL_MARKER)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise SpoolNotOurs(
            f"spool {root} is not empty ({shown}) and has no {SPOOL_MARKER} marker, so it is not a spool "
            "hsstream created; refusing to use it, since the spool's clean-up deletes files. Point "
            "HSSTREAM_SPOOL_DIR at a new or empty directory (hsstream marks it as its own)."
        )
    fd = os.open(root / SPOOL_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write("This directory is an hsstream spool: hsstream deletes the hs-*.safetensors files in it.\n")
    os.chmod(root, SPOOL_MODE)
    return True


# -- the writer's lock ---------------------------------------------------------------------

#: As the Example connector: readers open the lock read-write (hs-connectors) as the same user.
LOCK_MODE = 0o644


class LockError(OSError):
    pass


class WriteLock:
    def __init__(self, data_path: str | os.PathLike[str], *, make_dirs: bool = False) -> None:
        self.path = lock_path_for(data_path)
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
