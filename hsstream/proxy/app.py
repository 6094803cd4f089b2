"""The serving proxy: vLLM's OpenAI routes passed through unchanged, and each finished request teed.

A bare ASGI application on purpose (no router, no request or response objects): every request
pays for what it does and nothing else, so the proxy's added latency stays a fraction of a
millisecond. What a client gets is what vLLM sent: its status, its headers (but the hop-by-hop
ones, which belong to each connection), and its body bytes as they arrive, each streamed chunk
forwarded as it is read, nothing parsed on the way. ``date`` and ``server`` are vLLM's too
(uvicorn runs with its own turned off).

Only ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models`` reach vLLM;
every other path is answered here (404), so a vLLM started with ``VLLM_SERVER_DEV_MODE=1`` (the
weight-update and debug routes) behind the proxy exposes none of them. The proxy's own routes
are ``/healthz``, ``/metrics`` and ``/admin/*`` (its admin token: ``admin.py``).

A client that disconnects cancels its exchange, which closes the connection to vLLM, and vLLM
aborts the request (it watches its clients). Auth: with ``HSSTREAM_PROXY_API_KEY`` clients
present the proxy's key and vLLM gets ``HSSTREAM_PROXY_UPSTREAM_API_KEY`` (vLLM's
``--api-key``); without it the client's ``Authorization`` passes to vLLM unchanged.

The tee never touches the response path: a request sampled for it has its reply's bytes
copied into a buffer as they are forwarded, and once the reply is whole and 200 the request
and the buffer go to the tee's bounded queue (``tee.py``), which parses them on its own thread.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
from typing import Any

import aiohttp

from hsstream.proxy.metrics import ProxyMetrics
from hsstream.proxy.settings import ProxySettings
from hsstream.proxy.tee import Tee, TeeRecord
from hsstream.proxy.upstreams import Upstream, Upstreams

log = logging.getLogger("hsstream.proxy")

#: path -> (method, route name). Nothing else is forwarded.
OPENAI_ROUTES = {
    "/v1/chat/completions": ("POST", "chat"),
    "/v1/completions": ("POST", "completions"),
    "/v1/models": ("GET", "models"),
}
TEED = ("chat", "completions")

#: Hop-by-hop headers (RFC 9110 7.6.1) and those the proxy sets itself: never passed on.
_REQUEST_DROP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                           b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})  # fmt: skip
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"te", b"trailer",
                            b"transfer-encoding", b"upgrade"})  # fmt: skip
_SKIP_AUTO = frozenset({"Accept", "Accept-Encoding", "User-Agent", "Content-Type"})
_FALSE = (b"", b"0", b"false", b"no", b"off")


class UpstreamCut(Exception):
    """vLLM ended a reply the client had started to receive: the connection is closed unfinished."""


def error_body(status: int, message: str, kind: str) -> bytes:
    """An error in vLLM's own shape (``ErrorResponse``), so clients parse the proxy's like vLLM's."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


async def send_json(send: Any, status: int, body: bytes | dict | list, headers: list | None = None) -> None:  # noqa: ANN401
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *(headers or [])]})  # fmt: skip
    await send({"type": "http.response.body", "body": raw})


async def read_body(receive: Any, limit: int) -> bytes | None:  # noqa: ANN401
    """The request body, or None when it is over ``limit`` (or the client left while sending it)."""
    parts, n = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        n += len(chunk)
        if n > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body"):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _disconnected(receive: Any) -> None:  # noqa: ANN401
    while (await receive())["type"] != "http.disconnect":
        pass


def header(scope: dict, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def bearer_ok(scope: dict, token: str | None) -> bool:
    got = header(scope, b"authorization") or b""
    return bool(token) and hmac.compare_digest(got, b"Bearer " + token.encode())  # type: ignore[union-attr]


class _Exchange:
    __slots__ = ("status", "started", "complete", "buf")

    def __init__(self, keep: bool) -> None:
        self.status = 0
        self.started = False
        self.complete = False
        self.buf: bytearray | None = bytearray() if keep else None


class ProxyApp:
    def __init__(self, s: ProxySettings, upstreams: Upstreams, metrics: ProxyMetrics, tee: Tee | None = None,
                 admin: Any = None, rng: random.Random | None = None) -> None:  # noqa: ANN401  # fmt: skip
        self.s, self.upstreams, self.m, self.tee, self.admin = s, upstreams, metrics, tee, admin
        self.session: aiohttp.ClientSession | None = None
        self._rng = rng or random.Random()
        self._private = s.private_header.encode()
        self._auth_out = (b"authorization", b"Bearer " + s.upstream_api_key.encode()) if s.upstream_api_key else None
        self._admin_token = s.resolved_admin_token(create=False)
        self._requests = {(r, st): metrics.requests.labels(r, str(st)) for r in ("chat", "completions", "models")
                          for st in (200, 400, 401, 404, 500, 502, 504)}  # fmt: skip

    # ------------------------------------------------------------------ life cycle
    async def startup(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.s.upstream_keepalive_s, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                             timeout=aiohttp.ClientTimeout(total=None, connect=self.s.connect_timeout_s,
                                                                           sock_read=self.s.read_timeout_s))  # fmt: skip
        if self.tee is not None:
            self.tee.start()
        if self.admin is not None:
            await self.admin.startup(self)

    async def shutdown(self) -> None:
        if self.admin is not None:
            await self.admin.shutdown()
        if self.session is not None:
            await self.session.close()
        if self.tee is not None:
            await asyncio.to_thread(self.tee.stop)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:  # noqa: ANN401
        t = scope["type"]
        if t == "http":
            path = scope["path"]
            r = OPENAI_ROUTES.get(path)
            if r is not None:
                if scope["method"] != r[0]:
                    await send_json(send, 405, error_body(405, f"{path} takes {r[0]}", "MethodNotAllowed"),
                                    [(b"allow", r[0].encode())])  # fmt: skip
                    return
                await self.forward(scope, receive, send, r[1])
            elif path == "/healthz":
                await send_json(send, 200, {"ok": True, "live": self.upstreams.live.version})
            elif path == "/metrics":
                await self.metrics(scope, send)
            elif path.startswith("/admin/") and self.admin is not None:
                if not bearer_ok(scope, self._admin_token):
                    await send_json(send, 401, error_body(401, "the proxy's admin token is needed "
                                                          "(HSSTREAM_PROXY_ADMIN_TOKEN or STATE_DIR/admin.token)",
                                                          "Unauthorized"))  # fmt: skip
                    return
                await self.admin.handle(scope, receive, send)
            else:
                await send_json(send, 404, error_body(404, f"{path}: the proxy forwards only "
                                                      + ", ".join(OPENAI_ROUTES), "NotFoundError"))  # fmt: skip
        elif t == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    try:
                        await self.startup()
                    except Exception as e:  # noqa: BLE001
                        log.exception("proxy start-up failed")
                        await send({"type": "lifespan.startup.failed", "message": str(e)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def metrics(self, scope: dict, send: Any) -> None:  # noqa: ANN401
        if self.s.api_key and not (bearer_ok(scope, self.s.api_key) or bearer_ok(scope, self._admin_token)):
            await send_json(send, 401, {"error": "Unauthorized"})
            return
        body, ctype = self.m.exposition()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    # ------------------------------------------------------------------ forwarding
    def _count(self, route: str, status: int) -> None:
        c = self._requests.get((route, status))
        (c or self.m.requests.labels(route, str(status))).inc()

    def _headers_out(self, scope: dict) -> list[tuple[str, str]]:
        out = []
        for k, v in scope["headers"]:
            if k in _REQUEST_DROP or k == self._private:
                continue
            if k == b"authorization" and self.s.api_key:
                continue  # the proxy's key, not vLLM's
            out.append((k.decode("latin-1"), v.decode("latin-1")))
        if self.s.api_key and self._auth_out is not None:
            out.append(("authorization", self._auth_out[1].decode("latin-1")))
        return out

    def _tee_wanted(self, scope: dict, route: str, body: bytes) -> bool:
        tee = self.tee
        if tee is None or route not in TEED:
            return False
        p = header(scope, self._private)
        if not self.s.tee or (p is not None and p.strip().lower() not in _FALSE):
            tee.count("private")
            return False
        if self.s.sample_fraction < 1.0 and self._rng.random() >= self.s.sample_fraction:
            tee.count("sampled_out")
            return False
        if len(body) > self.s.max_tee_bytes:
            tee.count("too_large")
            return False
        return True

    async def forward(self, scope: dict, receive: Any, send: Any, route: str) -> None:  # noqa: ANN401
        if self.s.api_key and not bearer_ok(scope, self.s.api_key):
            self._count(route, 401)
            await send_json(send, 401, {"error": "Unauthorized"})  # what vLLM's --api-key answers
            return
        body = await read_body(receive, self.s.max_body_bytes)
        if body is None:
            self._count(route, 413)
            await send_json(send, 413, error_body(413, f"request body over {self.s.max_body_bytes} bytes "
                                                  "(HSSTREAM_PROXY_MAX_BODY_BYTES)", "RequestTooLarge"))  # fmt: skip
            return
        keep = self._tee_wanted(scope, route, body)
        up = self.upstreams.acquire()
        ex = _Exchange(keep)
        pump = asyncio.ensure_future(self._exchange(up, scope, body, send, route, ex))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                watch.cancel()
                pump.result()  # an UpstreamCut: the client's connection is closed unfinished
            else:  # the client left: closing our connection to vLLM aborts its request there
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
                self.m.disconnects.labels(route).inc()
        finally:
            self.upstreams.release(up)
            if keep:
                if ex.complete and ex.status == 200 and ex.buf is not None:
                    self.tee.offer(TeeRecord(route, body, bytes(ex.buf)))  # type: ignore[union-attr]
                elif ex.buf is None:
                    self.tee.count("too_large")  # type: ignore[union-attr]
                else:
                    self.tee.count("not_ok")  # type: ignore[union-attr]

    async def _exchange(self, up: Upstream, scope: dict, body: bytes, send: Any, route: str, ex: _Exchange) -> None:  # noqa: ANN401
        qs = scope.get("query_string") or b""
        url = up.url + scope["path"] + ("?" + qs.decode("latin-1") if qs else "")
        assert self.session is not None
        try:
            resp = await self.session.request(scope["method"], url, data=body if body else None,
                                              headers=self._headers_out(scope), skip_auto_headers=_SKIP_AUTO,
                                              allow_redirects=False)  # fmt: skip
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            self.m.upstream_errors.labels("connect").inc()
            self._count(route, 502)
            await send_json(send, 502, error_body(502, f"the serving vLLM at {up.url} did not answer: {e}", "BadGateway"))
            return
        except asyncio.TimeoutError:
            self.m.upstream_errors.labels("timeout").inc()
            self._count(route, 504)
            await send_json(send, 504, error_body(504, f"the serving vLLM at {up.url} did not answer in time",
                                                  "GatewayTimeout"))  # fmt: skip
            return
        try:
            ex.status = resp.status
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _RESPONSE_DROP]})  # fmt: skip
            ex.started = True
            limit = self.s.max_tee_bytes - len(body)
            try:
                async for chunk in resp.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if ex.buf is not None:
                        if len(ex.buf) + len(chunk) > limit:
                            ex.buf = None
                        else:
                            ex.buf += chunk
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    asyncio.TimeoutError) as e:  # fmt: skip
                self.m.upstream_errors.labels("cut" if not isinstance(e, asyncio.TimeoutError) else "timeout").inc()
                self._count(route, resp.status)
                raise UpstreamCut(f"the serving vLLM at {up.url} cut a reply: {e!r}") from e
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            ex.complete = True
            self._count(route, resp.status)
        finally:
            resp.release() if ex.complete else resp.close()
