"""Connections a client opens and does not use are closed: a request head sent a byte at a
time (slowloris), a connection that never sends anything, one idle after its last answer, and
any beyond the connection limit (answered 503 and closed at once). Meanwhile normal requests
are served. A real `hsstream serve` (uvicorn), no vLLM behind it, short limits."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.integration.conftest import sidecar_without_vllm

HEADER_S, IDLE_S, MAX_CONN = 2.0, 1.0, 16


@pytest.fixture(scope="module")
def sidecar(tiny_model):
    with sidecar_without_vllm(tiny_model, "conn-token", "hsstream-conn-", HSSTREAM_HTTP_HEADER_TIMEOUT_S=str(HEADER_S),
                              HSSTREAM_HTTP_IDLE_TIMEOUT_S=str(IDLE_S),
                              HSSTREAM_HTTP_MAX_CONNECTIONS=str(MAX_CONN)) as sc:  # fmt: skip
        yield sc


def _closed(s: socket.socket) -> bytes | None:
    """What the server sent before closing, once it has closed; None while it is open."""
    s.settimeout(0.05)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


def _served(url: str) -> None:
    t0 = time.monotonic()
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.0


def test_a_head_sent_a_byte_at_a_time_is_cut_off(sidecar):
    s = socket.create_connection(("127.0.0.1", sidecar.port))
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    closed = None
    while closed is None and time.monotonic() - t0 < 4 * HEADER_S:
        try:
            s.sendall(b"X")  # one byte of a header that never ends
        except (BrokenPipeError, ConnectionResetError):
            closed = b""
            break
        _served(sidecar.url)
        time.sleep(0.5)
        closed = _closed(s)
    took = time.monotonic() - t0
    s.close()
    assert closed is not None, f"a slow request head kept its connection for {took:.1f} s"
    assert took < HEADER_S + 1.5, took
    assert closed == b"" or closed.startswith(b"HTTP/1.1 408"), closed[:200]


def test_idle_connections_are_closed(sidecar):
    silent = socket.create_connection(("127.0.0.1", sidecar.port))  # never sends a byte
    used = socket.create_connection(("127.0.0.1", sidecar.port))  # one request, then idle
    used.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    assert used.recv(4096).startswith(b"HTTP/1.1 200")
    t0, gone = time.monotonic(), {}
    while len(gone) < 2 and time.monotonic() - t0 < 4 * HEADER_S:
        for name, s in (("silent", silent), ("used", used)):
            if name not in gone and _closed(s) is not None:
                gone[name] = time.monotonic() - t0
        _served(sidecar.url)
        time.sleep(0.1)
    silent.close()
    used.close()
    assert set(gone) == {"silent", "used"}, f"still open after {time.monotonic() - t0:.1f} s: {gone}"
    assert gone["used"] < IDLE_S + 1.0 and gone["silent"] < HEADER_S + 1.0, gone


def test_connections_past_the_limit_are_refused_and_closed(sidecar):
    time.sleep(HEADER_S + 0.5)  # the earlier tests' connections are gone
    held = [socket.create_connection(("127.0.0.1", sidecar.port)) for _ in range(MAX_CONN)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", sidecar.port))
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        t0, closed = time.monotonic(), None
        while closed is None and time.monotonic() - t0 < 1.0:
            closed = _closed(extra)
        extra.close()
        assert closed is not None, "a connection past the limit was kept open"
        assert closed.startswith(b"HTTP/1.1 503") and b"HSSTREAM_HTTP_MAX_CONNECTIONS" in closed, closed[:300]
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    _served(sidecar.url)
