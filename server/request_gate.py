"""Who may send the sidecar a body, checked before a byte of it is read.

FastAPI reads and parses a request's body before a route's dependencies run, so a token checked
as a dependency came after the work: a stranger's upload was spooled to disk and a stranger's
JSON parsed on the event loop before the 401. This ASGI layer sits ahead of everything else
(the body limits, FastAPI's parsing, the routers) and answers from the request's head alone:

- **the token** (``Authorization: Bearer …``, compared in constant time): every path but the
  probes (:data:`OPEN_PATHS`) needs it, so an unknown path is a 401 too, not a map of routes;
- **one client's bodies**: at most ``max_uploads_per_client`` requests with a body from one
  address at a time, from the head to the answer (each holds up to its body limit in memory or
  on disk, and a place in the one admission queue); more get 429.

A refusal says ``connection: close``: the unread body is drained and dropped by the connection
(``server/connections.py``, a bounded linger) so the client reads the answer instead of a reset.
"""

from __future__ import annotations

import hmac
import json

#: Paths served without the token: the orchestrators' probes (``/readyz`` names its problems only
#: to holders of the token, ``server/routers/health.py``).
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
#: Methods whose requests carry a body (the only ones the API takes a body with is POST).
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

UNAUTHORIZED = "missing or wrong bearer token (Authorization: Bearer $HSSTREAM_API_TOKEN)"


def authorized(headers: list[tuple[bytes, bytes]], token: str) -> bool:
    """Whether the request's ``Authorization`` header is ``Bearer <token>``: compared with
    ``hmac.compare_digest``, whose time does not depend on how much of it a caller got right."""
    got = b""
    for k, v in headers:
        if k.lower() == b"authorization":
            got = v
            break
    return hmac.compare_digest(got, b"Bearer " + token.encode())


async def refuse(send, status: int, detail: str, extra: list[tuple[bytes, bytes]] = ()) -> None:  # noqa: ANN001
    """A JSON answer ``{"detail": …}`` that closes the connection (its body is never read)."""
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *extra]  # fmt: skip
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """The ASGI layer described in the module docstring. ``token`` None: an API served open
    (``HSSTREAM_ALLOW_OPEN``); the cap on concurrent bodies holds all the same."""

    def __init__(self, app, *, token: str | None, uploads_per_client: int, stats: dict[str, int] | None = None) -> None:  # noqa: ANN001
        """``stats``: where the refusals are counted (``/v1/stats`` ``http``)."""
        self.app = app
        self.token = token
        self.uploads_per_client = uploads_per_client
        self.active: dict[str, int] = {}  # client address -> its requests with a body in progress
        self.stats = stats if stats is not None else {}
        for k in ("unauthorized", "uploads_refused"):
            self.stats.setdefault(k, 0)

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.token and scope["path"] not in OPEN_PATHS and not authorized(scope["headers"], self.token):
            self.stats["unauthorized"] += 1
            await refuse(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        if scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("?",))[0]
        n = self.active.get(client, 0)
        if n >= self.uploads_per_client:
            self.stats["uploads_refused"] += 1
            await refuse(send, 429, f"{n} requests with a body from {client} are in progress, the limit per client "
                                    "(HSSTREAM_MAX_UPLOADS_PER_CLIENT): wait for one to be answered",
                         [(b"retry-after", b"1")])  # fmt: skip
            return
        self.active[client] = n + 1
        try:
            await self.app(scope, receive, send)
        finally:
            if (left := self.active[client] - 1) > 0:
                self.active[client] = left
            else:
                del self.active[client]
