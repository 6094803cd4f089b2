"""The submitter's HTTP client to vLLM: aiohttp behind three calls and three errors.

Why aiohttp, not httpx (which the rest of the project uses for its few calls): the submitter
makes one request per sample, 16 at a time, and the client's CPU is the sidecar's largest cost
per sample. httpcore 1.0's pool walks every pooled connection, with a readability syscall per
idle one, whenever a request starts or ends, even with the pool split in shards: several times
aiohttp's CPU per request (measured in docs/benchmarks.md, "Sidecar throughput on 2 CPU cores").

The submitter sees only :class:`Reply` and the :class:`HttpError` family, so its unit tests
fake this seam (``get``/``post_json``/``aclose``) and this module's mapping of aiohttp's errors
is tested once, against real local servers (tests/unit/server/test_vllm_http.py).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Protocol


class HttpError(Exception):
    """The request got no usable answer."""


class Unreachable(HttpError):
    """No connection, or it broke before the answer was read (refused, reset, server gone)."""


class TimedOut(HttpError):
    """No answer within the timeout (the engine may be alive but busy)."""


class BadResponse(HttpError):
    """An answer that is not valid HTTP (not the engine's availability: the request's own failure)."""


@dataclass(frozen=True)
class Reply:
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class Http(Protocol):
    async def get(self, url: str, *, timeout: float | None = None) -> Reply: ...

    async def post_json(self, url: str, body: object, *, timeout: float | None = None) -> Reply: ...

    async def aclose(self) -> None: ...


class AiohttpClient:
    """One aiohttp session (one keep-alive pool); create it inside the running event loop.

    ``timeout_s`` bounds connecting and each wait for the answer's bytes (as httpx's per-phase
    timeout did), not the request's total time."""

    def __init__(self, timeout_s: float, *, max_connections: int = 100) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._timeout_s = timeout_s
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0),
            timeout=self._timeout(timeout_s), json_serialize=json.dumps,
            skip_auto_headers=("User-Agent",),
        )  # fmt: skip

    def _timeout(self, seconds: float):  # noqa: ANN202
        return self._aiohttp.ClientTimeout(total=None, connect=seconds, sock_read=seconds)

    async def _request(self, method: str, url: str, timeout: float | None, **kw: object) -> Reply:
        aiohttp = self._aiohttp
        if timeout is not None:  # else the session's (None would mean no timeout at all)
            kw["timeout"] = self._timeout(timeout)
        try:
            async with self._session.request(method, url, **kw) as r:  # type: ignore[arg-type]
                return Reply(r.status, await r.read())
        except asyncio.TimeoutError as e:  # aiohttp's ServerTimeoutError and ConnectionTimeoutError too
            raise TimedOut(f"no answer from {url} within {timeout or self._timeout_s:g} s") from e
        except (aiohttp.ClientPayloadError, aiohttp.ClientResponseError) as e:
            raise BadResponse(f"{method} {url}: {e!r}") from e
        except (aiohttp.ClientConnectionError, OSError) as e:
            raise Unreachable(f"{method} {url}: {e!r}") from e
        except aiohttp.ClientError as e:  # e.g. an invalid URL
            raise HttpError(f"{method} {url}: {e!r}") from e

    async def get(self, url: str, *, timeout: float | None = None) -> Reply:
        return await self._request("GET", url, timeout)

    async def post_json(self, url: str, body: object, *, timeout: float | None = None) -> Reply:
        return await self._request("POST", url, timeout, json=body)

    async def aclose(self) -> None:
        await self._session.close()
