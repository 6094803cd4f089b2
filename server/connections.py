"""Bounds on the REST API's connections: how long a request head may take, how many connections
are held, and the file descriptors kept back for the sidecar's own.

uvicorn closes a connection idle after an answer (``timeout_keep_alive``), but nothing bounds
the wait for a request's head: a client that opens connections and sends a header byte now and
then (slowloris), or nothing at all, holds each one for ever, and with them file descriptors the
sidecar needs for vLLM, the ledger and the spool. Its ``limit_concurrency`` answers 503 and keeps
the connection. So the HTTP protocol here is uvicorn's own with a small guard added, in our own
layer rather than a proxy in front: a timer from a connection's start, and from the first byte of
each later request, to the end of that request's head (a client that takes longer gets 408 and
the connection closed); and a connection past the limit gets a 503 and is closed at once. The
guard sits on the parser uvicorn would pick (httptools, else h11), hooking only where a head
begins and ends. A slow *body* is not cut off: an upload of hundreds of MiB over a slow link is
legitimate, and the body limits bound its size (``server/body_limit.py``).
"""

from __future__ import annotations

import asyncio
import logging
import resource

from connector.contract.settings import Settings

log = logging.getLogger("hsstream.sidecar")

#: Descriptors kept for the sidecar's own use besides its vLLM connections: the ledger (SQLite
#: and its WAL), ZeroMQ sockets and their internals, spool files read for remote trainers, the
#: tokenizer's files, logs.
FD_RESERVE = 256

_HEAD = b"content-type: text/plain\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
_408 = b"HTTP/1.1 408 Request Timeout\r\n" + _HEAD
_503 = b"HTTP/1.1 503 Service Unavailable\r\n" + _HEAD


def _response(template: bytes, text: str) -> bytes:
    body = text.encode()
    return template % (len(body), body)


class _Guard:
    """The guard, mixed in before a uvicorn HTTP protocol class (see :func:`protocol_class`)."""

    header_timeout_s: float = 10.0
    max_connections: int = 512
    _header_timer: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:  # type: ignore[attr-defined]
            self._refused = True
            self.transport = transport
            transport.write(_response(_503, f"the sidecar holds {self.max_connections} connections, its limit "
                                             "(HSSTREAM_HTTP_MAX_CONNECTIONS): try again later\n"))  # fmt: skip
            transport.close()
            return
        super().connection_made(transport)  # type: ignore[misc]
        self._head_begins()  # the first request's head is due from now: a silent connection ends too

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        if self._refused:
            return  # never set up
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)  # type: ignore[misc]

    def _head_begins(self) -> None:
        if self._header_timer is None:
            loop = self.loop  # type: ignore[attr-defined]
            self._header_timer = loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _head_done(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _head_too_slow(self) -> None:
        self._header_timer = None
        t = self.transport  # type: ignore[attr-defined]
        cycle = self.cycle  # type: ignore[attr-defined]
        if not t.is_closing():
            if cycle is None or cycle.response_complete:  # never inside an answer still being sent
                t.write(_response(_408, f"no complete request head within {self.header_timeout_s:g} s "
                                        "(HSSTREAM_HTTP_HEADER_TIMEOUT_S)\n"))  # fmt: skip
            t.close()


def _httptools_guard() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpTools(_Guard, HttpToolsProtocol):
        def on_message_begin(self) -> None:
            self._head_begins()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._head_done()
            super().on_headers_complete()

    return GuardedHttpTools


def _h11_guard() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(_Guard, H11Protocol):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._refused or self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE:  # a head under way (h11 leaves IDLE once it is whole)
                self._head_begins()
            else:
                self._head_done()

    return GuardedH11


def protocol_class(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools if installed, else h11) with the guard, for ``http=``."""
    try:
        import httptools  # noqa: F401

        base = _httptools_guard()
    except ImportError:
        base = _h11_guard()
    return type(base.__name__, (base,), {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


def connection_limit(s: Settings) -> int:
    """``HSSTREAM_HTTP_MAX_CONNECTIONS``, within the process's file descriptors once those for
    vLLM (the submitter's pool) and :data:`FD_RESERVE` are kept back: the soft limit is raised
    toward the hard one if needed, and the connection limit lowered (with a warning) if even
    that is short, so clients can never take the descriptors the sidecar's own work needs."""
    keep = FD_RESERVE + s.max_concurrency + 16  # the submitter's aiohttp pool: concurrency + 16
    want = s.http_max_connections + keep
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        n = max(1, soft - keep)
        log.warning("only %d file descriptors (ulimit -n): HTTP connections limited to %d, not "
                    "HSSTREAM_HTTP_MAX_CONNECTIONS=%d, keeping %d for vLLM and the sidecar's own files",
                    soft, n, s.http_max_connections, keep)  # fmt: skip
        return n
    return s.http_max_connections
