"""A cached folder built once: under a lock, in a temporary sibling, published by one rename.

What ``hsstream models get`` and ``hsstream data get`` build takes minutes (a download, a
conversion, a check), and two processes may ask for the same one at once (two test sessions, a
trainer and ``hsstream up``). So the build holds an exclusive ``flock`` on ``.NAME.lock`` beside
the folder, writes into ``.NAME.tmp-*`` and renames that to ``NAME`` only after its marker
(written last) is in place: the name ``NAME`` never holds a half-built folder, whatever kills
the builder. A killed build leaves its temporary sibling; the next builder, holding the lock,
removes it (no one else can be writing it).

The marker holds a version string: a folder built by another version of the recipe is stale
and is built again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MARKER = "HSSTREAM_BUILD_OK"


def is_complete(path: str | Path, version: str) -> bool:
    """Whether ``path`` holds a finished build of ``version`` (its marker is written last)."""
    try:
        return (Path(path) / MARKER).read_text(encoding="utf-8").strip() == version
    except OSError:
        return False


def _lock(path: Path, say: Callable[[str], None]) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        say(f"waiting for another process building the same folder (lock {path})")
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def build_once(out: str | Path, version: str, build: Callable[[Path], None], *, force: bool = False,
               say: Callable[[str], None] = lambda _m: None) -> Path:  # fmt: skip
    """``out`` (absolute), built by ``build(tmp_dir)`` unless a complete build of ``version`` is
    there. ``build`` fills the empty folder it is given; an exception leaves nothing behind."""
    out = Path(out).expanduser().absolute()
    if not force and is_complete(out, version):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock(out.parent / f".{out.name}.lock", say)
    try:
        if not force and is_complete(out, version):  # another process finished it while we waited
            return out
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # a killed build's (we hold the lock)
            say(f"removing {stale} (left by a build that did not finish)")
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            build(tmp)
            (tmp / MARKER).write_text(version + "\n", encoding="utf-8")
            for f in tmp.rglob("*"):  # mkdtemp makes 0700, safetensors writes 0600: a shared cache reads them
                os.chmod(f, 0o755 if f.is_dir() else 0o644)
            os.chmod(tmp, 0o755)
            if out.exists() or out.is_symlink():  # stale or forced: out of the way first (rename needs a free name)
                trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-old-", dir=out.parent))
                os.rename(out, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        os.close(fd)  # releases the flock
    return out
