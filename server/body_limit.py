"""Request-size and request-time limits that hold for every body, ``Transfer-Encoding: chunked``
included.

Content-Length alone is no limit: a chunked body has none, and was read whole (a 300 MiB
body took the sidecar from 465 MB to 1 GB of RSS). This ASGI middleware counts the bytes as
the application reads them and stops at the limit with a 413, so at most the limit is ever
buffered. JSON bodies are parsed in memory, so their limit is small; multipart uploads are
spooled to disk by the form parser, so theirs can be large.

A body must also keep coming: a wait of more than ``body_timeout_s`` for its next piece is a
408 (the header timeout of ``server/connections.py`` ends where the body begins, so a client
could otherwise hold a connection, a place among the uploads of its address and the spooled
part of its body for ever by stalling mid-body). Only the wait for the next piece is bounded,
not the whole body: an upload of hundreds of MiB over a slow link is legitimate.

Every refusal closes the connection (``connection: close``); the rest of the body is drained
and dropped by the connection's linger (``server/connections.py``), so the client reads the
413 rather than a reset.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import HTTPException

CLOSE = {"connection": "close"}


class BodyTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body parsing passes it on as the 413 it is."""

    def __init__(self, limit: int, setting: str) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit:,} bytes ({setting})", headers=CLOSE)


class BodyTimeout(HTTPException):
    """A body that stopped coming: 408, passed on by FastAPI's body parsing like :class:`BodyTooLarge`."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body stopped: nothing of it for {timeout_s:g} s "
                              "(HSSTREAM_HTTP_BODY_TIMEOUT_S)", headers=CLOSE)  # fmt: skip


class BodyLimit:
    def __init__(self, app, *, json_bytes: int, upload_bytes: int, body_timeout_s: float = 60.0,  # noqa: ANN001
                 stats: dict[str, int] | None = None) -> None:  # fmt: skip
        """``stats``: where the refusals are counted (``/v1/stats`` ``http``)."""
        self.app = app
        self.json_bytes = json_bytes
        self.upload_bytes = upload_bytes
        self.body_timeout_s = body_timeout_s
        self.stats = stats if stats is not None else {}
        for k in ("bodies_too_large", "body_timeouts"):
            self.stats.setdefault(k, 0)

    def _limit(self, headers: dict[bytes, bytes]) -> tuple[int, str]:
        if headers.get(b"content-type", b"").lower().startswith(b"multipart/form-data"):
            return self.upload_bytes, "HSSTREAM_MAX_BODY_BYTES, for uploads"
        return self.json_bytes, "HSSTREAM_MAX_JSON_BYTES; send large jobs to /v1/jobs/upload"

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        limit, setting = self._limit(headers)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            self.stats["bodies_too_large"] += 1
            await self._refuse(send, BodyTooLarge(limit, setting))
            return
        seen = 0
        started = False
        body_done = False

        async def counted_receive():  # noqa: ANN202
            nonlocal seen, body_done
            if body_done:  # after the body: a wait for the disconnect, which has no deadline
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                self.stats["body_timeouts"] += 1
                raise BodyTimeout(self.body_timeout_s) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                body_done = not msg.get("more_body", False)
                if seen > limit:
                    self.stats["bodies_too_large"] += 1
                    raise BodyTooLarge(limit, setting)
            else:
                body_done = True
            return msg

        async def watched_send(msg) -> None:  # noqa: ANN001
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted_receive, watched_send)
        except (BodyTooLarge, BodyTimeout) as e:  # raised where no handler turned it into a response
            if started:
                raise
            await self._refuse(send, e)

    @staticmethod
    async def _refuse(send, e: HTTPException) -> None:  # noqa: ANN001
        body = json.dumps({"detail": e.detail}).encode()
        await send({"type": "http.response.start", "status": e.status_code,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
