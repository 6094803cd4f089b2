"""The REST connection limit leaves file descriptors for the sidecar's own connections to vLLM
and its files (server/connections.py; the slow and idle connections themselves are tested on a
real uvicorn in tests/integration/server/test_sidecar_connections.py)."""

from __future__ import annotations

import resource

from connector.contract.settings import Settings
from server import connections as C


def _limits(monkeypatch, soft: int, hard: int, can_raise: bool) -> list:
    calls = []

    def setrlimit(which, lim):  # noqa: ANN001
        calls.append(lim)
        if not can_raise:
            raise ValueError("not permitted")

    monkeypatch.setattr(C.resource, "getrlimit", lambda which: (soft, hard))
    monkeypatch.setattr(C.resource, "setrlimit", setrlimit)
    return calls


def test_enough_descriptors_leave_the_setting_as_it_is(monkeypatch):
    calls = _limits(monkeypatch, 20_000, 20_000, can_raise=True)
    assert C.connection_limit(Settings(http_max_connections=512)) == 512 and calls == []


def test_the_soft_limit_is_raised_toward_the_hard_one(monkeypatch):
    calls = _limits(monkeypatch, 256, 4096, can_raise=True)
    s = Settings(http_max_connections=512, max_concurrency=16)
    assert C.connection_limit(s) == 512
    assert calls == [(512 + C.FD_RESERVE + 16 + 16, 4096)]


def test_too_few_descriptors_lower_the_connection_limit_not_the_reserve(monkeypatch, caplog):
    _limits(monkeypatch, 1024, 1024, can_raise=False)
    s = Settings(http_max_connections=4096, max_concurrency=16)
    assert C.connection_limit(s) == 1024 - C.FD_RESERVE - 32
    assert "HSSTREAM_HTTP_MAX_CONNECTIONS=4096" in caplog.text


def test_unlimited_descriptors(monkeypatch):
    _limits(monkeypatch, resource.RLIM_INFINITY, resource.RLIM_INFINITY, can_raise=True)
    assert C.connection_limit(Settings(http_max_connections=100)) == 100
