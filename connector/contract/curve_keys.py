"""CURVE key files (ZeroMQ's certificate format): written private, refused when not private.

A secret key file is the whole of a trainer's or the sidecar's identity on the remote delivery
endpoint: whoever reads it can take samples (users' prompts, hidden states) or pose as the
sidecar. So ``hsstream keys`` writes it 0600 in a 0700 folder, and every process that loads
one (the sidecar, ``HiddenStateStream``) refuses a file others may read, as ssh does.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SECRET_MODE = 0o600
KEYS_DIR_MODE = 0o700


class InsecureKeyFile(PermissionError):
    """A secret key file that group or others may read or write."""


def check_secret_file(path: str | os.PathLike[str]) -> None:
    """Refuse a secret key file with any group/other permission bit, naming the fix."""
    p = Path(path)
    mode = stat.S_IMODE(os.stat(p).st_mode)
    if mode & 0o077:
        raise InsecureKeyFile(
            f"CURVE secret key file {p} is accessible to other users (mode {mode:04o}); "
            f"it must be private: run `chmod 600 {p}`"
        )


def load_secret(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    """``zmq.auth.load_certificate`` after the permission check: (public, secret) keys."""
    import zmq.auth

    check_secret_file(path)
    return zmq.auth.load_certificate(str(path))


def write_key_pair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Create ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600) in ``directory``.

    The folder is created 0700; an existing one must not be writable by others (they could
    swap the keys). The files are created under umask 077, so the secret is never readable
    by others, not even between its creation and a chmod."""
    import zmq.auth

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=KEYS_DIR_MODE)
    st = os.stat(d)
    if st.st_mode & 0o022:
        raise InsecureKeyFile(
            f"key folder {d} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"run `chmod 700 {d}` or choose a new folder"
        )
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old)
    os.chmod(sec, SECRET_MODE)
    os.chmod(pub, 0o644)  # the public half is meant to be copied to other hosts
    return Path(pub), Path(sec)
