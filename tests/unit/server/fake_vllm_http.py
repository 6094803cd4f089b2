"""A fake vLLM at the submitter's HTTP seam (server.vllm_http.Http): a handler answers each
request, or raises one of the seam's errors. What aiohttp does on the wire, and how its errors
map to those, is tested against real local servers in tests/unit/server/test_vllm_http.py."""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from server.vllm_http import Reply


@dataclass(frozen=True)
class Request:
    method: str
    host: str
    path: str
    body: object | None  # the JSON body, as the engine would parse it


def reply(status: int = 200, body: object | None = None) -> Reply:
    return Reply(status, b"" if body is None else json.dumps(body).encode())


Handler = Callable[[Request], "Reply | Awaitable[Reply]"]


class FakeHttp:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.closed = False

    async def _call(self, method: str, url: str, body: object | None) -> Reply:
        u = urlsplit(url)
        r = self.handler(Request(method, u.hostname or "", u.path, body))
        return await r if inspect.isawaitable(r) else r  # type: ignore[return-value]

    async def get(self, url: str, *, timeout: float | None = None) -> Reply:
        return await self._call("GET", url, None)

    async def post_json(self, url: str, body: object, *, timeout: float | None = None) -> Reply:
        return await self._call("POST", url, json.loads(json.dumps(body)))

    async def aclose(self) -> None:
        self.closed = True
