"""The serving proxy under real uvicorn on a free port, in a thread of the test process, and a
stub upstream (aiohttp.web) for what a real vLLM cannot be made to do on cue: fail, hang, cut
a stream, notice a client leaving.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProxyThread:
    """``serve.build_app`` + ``serve.run``'s uvicorn settings, in a thread; ``stop()`` ends it."""

    def __init__(self, settings: Any, **build: Any) -> None:  # noqa: ANN401
        import uvicorn

        from hsstream.proxy.serve import build_app
        from server.connections import protocol_class

        self.s = settings
        self.app = build_app(settings, **build)
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=settings.port, log_level="warning", lifespan="on",
                             http=protocol_class(settings.http_header_timeout_s, settings.max_connections),
                             timeout_keep_alive=settings.http_idle_timeout_s, server_header=False, date_header=False)  # fmt: skip
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, name="proxy-under-test", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.s.port}"

    @property
    def admin_headers(self) -> dict:
        return {"authorization": f"Bearer {self.s.resolved_admin_token()}"}

    def start(self) -> ProxyThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > 30:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def proxy_settings(tmp: Path, upstream: str, **kw: Any):  # noqa: ANN201, ANN401
    from hsstream.proxy.settings import ProxySettings

    base = dict(port=free_port(), upstream=upstream, state_dir=tmp / "proxy-state", sidecar_url="http://127.0.0.1:9",
                flush_s=0.2)  # fmt: skip
    base.update(kw)
    return ProxySettings(**base)


@contextmanager
def running_proxy(settings: Any, **build: Any) -> Iterator[ProxyThread]:  # noqa: ANN401
    p = ProxyThread(settings, **build).start()
    try:
        yield p
    finally:
        p.stop()


class StubUpstream:
    """An aiohttp.web server in a thread. ``handler(request) -> response`` per path; it records
    each request's fate (``events``: ("start", path), ("done", path), ("cancelled", path))."""

    def __init__(self, routes: dict[str, Callable]) -> None:
        self.routes = routes
        self.port = free_port()
        self.events: list[tuple[str, str]] = []
        self.requests: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stub-upstream", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)

        async def dispatch(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
            self.events.append(("start", request.path))
            try:
                resp = await self.routes[request.path](request, body)
                self.events.append(("done", request.path))
                return resp
            except asyncio.CancelledError:  # aiohttp cancels the handler when its client goes
                self.events.append(("cancelled", request.path))
                raise

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", dispatch)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def start(self) -> StubUpstream:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def wait_event(self, ev: tuple[str, str], timeout: float = 10.0) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if ev in self.events:
                return True
            time.sleep(0.02)
        return False


def get(url: str, **kw: Any) -> httpx.Response:  # noqa: ANN401
    return httpx.get(url, timeout=30, **kw)
