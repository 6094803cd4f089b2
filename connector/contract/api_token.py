"""Where the sidecar's REST token comes from: for the sidecar, and for every client of it.

The REST API hands out the users' prompts (``GET /v1/jobs/{id}/samples``) and takes jobs, and
every local user reaches 127.0.0.1: so the sidecar has a token on loopback too. It is
``HSSTREAM_API_TOKEN`` when that is set; else the sidecar makes one when it starts (or keeps the
one it made before, so a restart does not lock out clients that read it) and writes it, readable
by this user only, to ``<run dir>/api-token`` (:data:`TOKEN_FILE`; the run dir is private too).
Every client of ours that runs with the same settings reads it there (``hsstream
submit/status/top/train/eval``, ``hsstream up``'s children, the demo, :class:`SidecarClient`
given no token): nothing to configure on one host. Only ``HSSTREAM_ALLOW_OPEN=1`` (``hsstream
serve --insecure-no-token``) serves without any.

Imports nothing of ours but the settings' default run dir, so a client reads the token without
building the sidecar's settings (which refuse some environments outright).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

#: The token's file in the run dir (``HSSTREAM_RUN_DIR``).
TOKEN_FILE = "api-token"
#: Where a client looks for the token when none is passed: this variable, then the run dir's file.
TOKEN_ENV = "HSSTREAM_API_TOKEN"


class TokenFileError(RuntimeError):
    """The token file exists but cannot be trusted (not ours, or others can read it)."""


def _run_dir(run_dir: str | Path | None) -> Path:
    if run_dir is not None:
        return Path(run_dir)
    from connector.contract.settings import _default_run_dir

    return Path(os.environ.get("HSSTREAM_RUN_DIR") or _default_run_dir())


def token_path(run_dir: str | Path | None = None) -> Path:
    """``<run dir>/api-token`` (the settings' run dir when None)."""
    return _run_dir(run_dir) / TOKEN_FILE


def read_token(run_dir: str | Path | None = None) -> str | None:
    """The token the sidecar of this run dir made, or None when it made none (it has one set, or
    never ran here). A file another user owns, or that group or others may read, is refused."""
    path = token_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with os.fdopen(fd, "r", encoding="ascii", errors="replace") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise TokenFileError(f"{path} must be a file of this user that only it can read (chmod 600 {path})")
        token = f.read(256).strip()
    return token or None


def ensure_token(run_dir: str | Path) -> str:
    """The sidecar's token when none is set: the one already in the run dir, else a new one
    (``secrets.token_hex(32)``) written there 0600, atomically (a client never reads half of it)."""
    if (token := read_token(run_dir)) is not None:
        return token
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_hex(32)
    tmp = d / f".{TOKEN_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    os.rename(tmp, d / TOKEN_FILE)
    return token


def client_token(token: str | None = None, run_dir: str | Path | None = None) -> str:
    """The token a client sends: ``token`` if given, else ``HSSTREAM_API_TOKEN``, else the run
    dir's file (:func:`read_token`), else none (``""``: a sidecar serving open)."""
    if token:
        return token
    if env := os.environ.get(TOKEN_ENV):
        return env
    try:
        return read_token(run_dir) or ""
    except OSError:  # a run dir this user cannot enter: no token of ours there
        return ""
