"""Request-size limits that hold for every body, ``Transfer-Encoding: chunked`` included.

Content-Length alone is no limit: a chunked body has none, and was read whole (a 300 MiB
body took the sidecar from 465 MB to 1 GB of RSS). This ASGI middleware counts the bytes as
the application reads them and stops at the limit with a 413, so at most the limit is ever
buffered. JSON bodies are parsed in memory, so their limit is small; multipart uploads are
spooled to disk by the form parser, so theirs can be large.
"""

from __future__ import annotations

import json

from fastapi import HTTPException


class BodyTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body parsing passes it on as the 413 it is."""

    def __init__(self, limit: int, setting: str) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit:,} bytes ({setting})")


class BodyLimit:
    def __init__(self, app, *, json_bytes: int, upload_bytes: int) -> None:  # noqa: ANN001
        self.app = app
        self.json_bytes = json_bytes
        self.upload_bytes = upload_bytes

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
            await self._refuse(send, BodyTooLarge(limit, setting))
            return
        seen = 0
        started = False

        async def counted_receive():  # noqa: ANN202
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit, setting)
            return msg

        async def watched_send(msg) -> None:  # noqa: ANN001
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as e:  # raised where no handler turned it into a response
            if started:
                raise
            await self._refuse(send, e)

    @staticmethod
    async def _refuse(send, e: BodyTooLarge) -> None:  # noqa: ANN001
        body = json.dumps({"detail": e.detail}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
