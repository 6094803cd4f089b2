"""A TCP proxy in front of one vLLM engine that can hold a completion in flight, on cue.

A test that kills an engine "while it holds one of our requests" needs that moment for certain,
and a 40-token request on the tiny model lasts milliseconds. With this proxy between the sidecar
and the engine, the test arms it; the completions it lets through first pass as usual, then the
next ``POST /v1/completions`` is kept at the proxy — never sent on, so the engine cannot produce
its file — and :attr:`HoldingProxy.holding` is set. Killing the engine then closes the proxy's
connections, and the sidecar sees the held request fail without an answer, exactly as when an
engine dies mid-request; the sample can only be produced again elsewhere. Everything else
(health probes, ``/v1/models``, unarmed traffic) is passed through unchanged, byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading


class HoldingProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.holding = threading.Event()  # set once an armed completion is held
        self.held = 0  # completions kept at the proxy
        self._armed = False
        self._pass = 0  # armed: completions still to pass through before one is held
        self._loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind((host, 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="holding-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")

    @property
    def url(self) -> str:
        return f"http://{self.upstream[0]}:{self.port}"

    def arm(self, after: int = 0) -> None:
        """Let ``after`` more completions through, then hold the next one on each connection
        (never sent on). Counted here, on the proxy's own thread, as the requests pass: no
        polling, so no race with how fast the engine answers."""
        self._pass = after
        self._armed = True

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # ------------------------------------------------------------------ the loop's side
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._client, sock=self._sock)

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        self._loop.close()

    async def _client(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:  # the engine is gone: the client sees the connection close, as it would
            down_w.close()
            return
        held = asyncio.Event()

        async def requests() -> None:
            while data := await down_r.read(65536):
                if self._armed and not held.is_set() and data.startswith(b"POST /v1/completions"):
                    if self._pass > 0:
                        self._pass -= 1
                    else:
                        held.set()
                        self.held += 1
                        self.holding.set()
                if held.is_set():
                    continue  # the held request (and anything after it here) stays at the proxy
                up_w.write(data)
                await up_w.drain()
            up_w.close()

        async def answers() -> None:
            while data := await up_r.read(65536):
                if not held.is_set():
                    down_w.write(data)
                    await down_w.drain()
            down_w.close()  # the engine closed (or died): so does the client's connection

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(answers())]
        with contextlib.suppress(Exception):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        for w in (up_w, down_w):
            w.close()
