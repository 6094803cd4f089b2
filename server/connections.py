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
begins and ends. A slow *body* is not cut off as long as it keeps coming: an upload of hundreds
of MiB over a slow link is legitimate; the body limits bound its size and the wait for each of
its pieces (``server/body_limit.py``).

A request refused before its body was read (a 401 from ``server/request_gate.py``, a 413, a 408)
is answered with ``connection: close``. Closing a socket with unread data in it sends a reset,
and the client, still sending its body, then loses the answer too (a 17 MiB JSON body saw a
reset, not its 413). So such a connection *lingers* instead: its write side is shut after the
answer (FIN), and what still arrives is read and dropped, unparsed, until the client closes, no
byte came for :data:`LINGER_IDLE_S` or :data:`LINGER_MAX_S` passed; then it is closed.
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

#: A lingering connection (module docstring) is closed once the client has sent nothing for this
#: long, or after :data:`LINGER_MAX_S` whatever it sends.
LINGER_IDLE_S = 5.0
LINGER_MAX_S = 30.0

_HEAD = b"content-type: text/plain\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
_408 = b"HTTP/1.1 408 Request Timeout\r\n" + _HEAD
_503 = b"HTTP/1.1 503 Service Unavailable\r\n" + _HEAD


def _response(template: bytes, text: str) -> bytes:
    body = text.encode()
    return template % (len(body), body)


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: ``close()`` lingers (module docstring)
    when an answer went out before the request's body was read whole; all else is the transport's."""

    def __init__(self, real: asyncio.Transport, guard: _Guard) -> None:
        self._real = real
        self._guard = guard

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._real, name)

    def close(self) -> None:
        if self._guard._lingering:
            return  # the linger ends it
        if self._guard._body_unread():
            self._guard._linger()
            return
        self._real.close()

    def is_closing(self) -> bool:
        return self._guard._lingering or self._real.is_closing()


class _Guard:
    """The guard, mixed in before a uvicorn HTTP protocol class (see :func:`protocol_class`)."""

    header_timeout_s: float = 10.0
    max_connections: int = 512
    _header_timer: asyncio.TimerHandle | None = None
    _refused = False
    _lingering = False
    _linger_timer: asyncio.TimerHandle | None = None
    _linger_until = 0.0
    _real_transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:  # type: ignore[attr-defined]
            self._refused = True
            self.transport = transport
            transport.write(_response(_503, f"the sidecar holds {self.max_connections} connections, its limit "
                                             "(HSSTREAM_HTTP_MAX_CONNECTIONS): try again later\n"))  # fmt: skip
            transport.close()
            return
        self._real_transport = transport
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[misc]
        self._head_begins()  # the first request's head is due from now: a silent connection ends too

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._refused:
            return  # never set up
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._lingering:  # the rest of a refused body: dropped unparsed
            self._linger_arm()
            return
        super().data_received(data)  # type: ignore[misc]

    def _body_unread(self) -> bool:
        """An answer is complete while the request's body is still coming."""
        cycle = getattr(self, "cycle", None)
        return cycle is not None and cycle.response_complete and cycle.more_body and not self._real_transport.is_closing()

    def _linger(self) -> None:
        """Shut the write side once the answer is out, read and drop what still comes (module docstring)."""
        real = self._real_transport
        self._lingering = True
        self._head_done()
        try:
            if not real.can_write_eof():
                real.close()
                return
            real.write_eof()
            real.resume_reading()  # uvicorn may have paused it (a body it had not read yet)
        except (OSError, RuntimeError):
            real.close()
            return
        self._linger_until = self.loop.time() + LINGER_MAX_S  # type: ignore[attr-defined]
        self._linger_arm()

    def _linger_arm(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        loop = self.loop  # type: ignore[attr-defined]
        at = min(loop.time() + LINGER_IDLE_S, self._linger_until)
        self._linger_timer = loop.call_at(at, self._real_transport.close)

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
