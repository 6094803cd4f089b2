"""Whether the sidecar's REST API may listen where it was told to, decided before it starts.

The API creates jobs and lists them (users' prompts go through it), so on an address other
machines can reach it needs the bearer token. An open API on a loopback address is the local
default (one user's own machine); anywhere else it is refused unless a person said, in so
many words, that it should be open (``HSSTREAM_ALLOW_OPEN=1`` or ``--insecure-no-token``).
One rule for ``hsstream serve`` and ``hsstream up``, which checks it before starting anything.
"""

from __future__ import annotations

import ipaddress

#: Tokens that are published (deploy/.env.example's placeholder): as good as none.
PLACEHOLDER_TOKENS = frozenset({"change-me"})

OPEN_WARNING = (
    "WARNING: the sidecar's REST API listens on {host} with {what}, and HSSTREAM_ALLOW_OPEN / "
    "--insecure-no-token was given: anyone who can reach this address can submit, read and "
    "cancel jobs. Set HSSTREAM_API_TOKEN to close it."
)


class OpenBindRefused(ValueError):
    """A non-loopback bind with no (real) token and no explicit override."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; any other name may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_api_exposure(host: str, token: str | None, allow_open: bool) -> str | None:
    """Raise :class:`OpenBindRefused` for an unprotected API on a reachable address; return the
    warning to log when the override was given (None when there is nothing to warn about)."""
    if is_loopback(host):
        return None
    if token and token not in PLACEHOLDER_TOKENS:
        return None
    what = "no token" if not token else f"the placeholder token {token!r} from deploy/.env.example"
    if allow_open:
        return OPEN_WARNING.format(host=host, what=what)
    raise OpenBindRefused(
        f"refusing to serve the REST API on {host} with {what}: anyone who can reach that address could "
        "submit and read jobs. Set HSSTREAM_API_TOKEN to a secret (e.g. `openssl rand -hex 32`), or bind "
        "127.0.0.1 (HSSTREAM_HOST / --host), or, to run it open on purpose, set HSSTREAM_ALLOW_OPEN=1 "
        "(`hsstream serve --insecure-no-token`)."
    )
