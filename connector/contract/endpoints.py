"""Which ZeroMQ endpoints may carry notices and samples without CURVE.

A notice names a file for the sidecar to deliver and later delete, and a delivery carries the
users' prompts (token ids) and hidden states: whoever can connect to those sockets can inject
the one or take the other. ``ipc://`` sockets live in a directory only our user can enter
(``server/notices.py: prepare_ipc``), so they are safe on one host; anything else (``tcp://``,
loopback included: every local user reaches 127.0.0.1; and ``ipc://@name``, a Linux abstract
socket, which has no file and so no permissions: every local user reaches it too) is refused
unless CURVE protects it or a
person said, in so many words, that it should be open (``HSSTREAM_ALLOW_INSECURE_TCP=1``),
which is then logged once per process as a WARNING. One rule for the connector (it connects
the notice socket), the sidecar (it binds both) and the stream (it connects to deliveries).
"""

from __future__ import annotations

import logging

log = logging.getLogger("hsstream")

ALLOW_SWITCH = "HSSTREAM_ALLOW_INSECURE_TCP"
#: Transports that never leave this host's user: a socket file in a private directory, or memory.
LOCAL_SCHEMES = ("ipc", "inproc")

_warned: set[str] = set()  # endpoints whose WARNING this process has logged


class InsecureEndpoint(Exception):  # noqa: N818 - named for what it refuses, like OpenBindRefused
    """A network endpoint without CURVE and without the explicit switch. Not a ValueError, so a
    settings model passes it through as it is, its message whole, instead of folding it into a
    validation error."""


def is_abstract(endpoint: str) -> bool:
    """True for ``ipc://@name``: a Linux abstract socket (no file, no permissions)."""
    scheme, sep, rest = endpoint.partition("://")
    return bool(sep) and scheme.lower() == "ipc" and rest.startswith("@")


def is_network(endpoint: str) -> bool:
    """True for an endpoint other hosts' or users' processes can reach (``tcp://`` and the like,
    and an abstract ``ipc://@name``, which any local user can connect to)."""
    scheme, sep, _ = endpoint.partition("://")
    return bool(sep) and (scheme.lower() not in LOCAL_SCHEMES or is_abstract(endpoint))


def check_plain(setting: str, endpoint: str, *, allow: bool, exposes: str, fix: str) -> None:
    """Refuse ``endpoint`` (named ``setting`` in the message) if it is a network endpoint used
    without CURVE, unless ``allow``; then log one WARNING for it in this process. ``exposes``:
    what anyone reaching it could do; ``fix``: how to do without it."""
    if not endpoint or not is_network(endpoint):
        return
    if is_abstract(endpoint):
        what, who = "a Linux abstract socket: it has no file, so no permissions", "any local user"
    else:
        what, who = "plain TCP, neither authenticated nor encrypted", "anyone who can reach that port (any local user, for 127.0.0.1)"
    if not allow:
        raise InsecureEndpoint(
            f"refusing {setting}={endpoint}: it is {what}, so {who} could {exposes}. {fix}. To run it "
            f"unauthenticated on purpose, on a network you trust, set {ALLOW_SWITCH}=1."
        )
    if endpoint not in _warned:
        _warned.add(endpoint)
        log.warning("WARNING: %s=%s is %s and %s=1 was given: %s can %s.", setting, endpoint, what, ALLOW_SWITCH,
                    who, exposes)  # fmt: skip


#: What a reachable notice / delivery socket gives away, and the way around it.
NOTICE_EXPOSES = "inject notices, naming spool files for the sidecar to deliver and delete"
DELIVERY_EXPOSES = "take samples (the users' prompts and their hidden states) and acknowledge them"
SIDECAR_FIX = ("Keep it on this host with ipc:// (the default); trainers on other hosts connect to "
               "HSSTREAM_REMOTE_ENDPOINT, which CURVE authenticates (make the keys with `hsstream keys DIR`: "
               "docs/multi-host.md)")  # fmt: skip
STREAM_FIX = ("Pass curve_server_key and curve_client_cert (make them with `hsstream keys DIR`; the sidecar "
              "serves CURVE on HSSTREAM_REMOTE_ENDPOINT: docs/multi-host.md)")  # fmt: skip
