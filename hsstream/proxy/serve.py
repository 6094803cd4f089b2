"""``hsstream proxy serve``: build the proxy (tee, store, admin) from its settings and run it
under uvicorn.

uvicorn runs with its ``date`` and ``server`` headers off (vLLM's pass through), httptools and
uvloop when installed, and the sidecar's connection guard (a request head within
``HSSTREAM_PROXY_HTTP_HEADER_TIMEOUT_S``, at most ``HSSTREAM_PROXY_MAX_CONNECTIONS``
connections, idle ones closed after ``HSSTREAM_PROXY_HTTP_IDLE_TIMEOUT_S``).
"""

from __future__ import annotations

import logging
from typing import Any

from hsstream.proxy.app import ProxyApp
from hsstream.proxy.metrics import ProxyMetrics
from hsstream.proxy.settings import ProxySettings
from hsstream.proxy.store import TeedStore
from hsstream.proxy.tee import Tee
from hsstream.proxy.upstreams import Upstream, Upstreams

log = logging.getLogger("hsstream.proxy")


def build_app(s: ProxySettings, *, version: str = "initial", draft: str | None = None, engines: Any = None,  # noqa: ANN401
              tee_client_factory: Any = None) -> ProxyApp:  # noqa: ANN401  # fmt: skip
    """The proxy with its store, tee and admin routes. ``engines``: an
    :class:`~hsstream.proxy.engines.EngineManager` when the proxy starts the serving engines
    itself (managed mode: swaps start a new engine); None: the upstream URL is the user's."""
    from hsstream.proxy.admin import Admin

    s.resolved_admin_token(create=True)
    m = ProxyMetrics()
    store = TeedStore(s.store_path(), dedup_window=s.dedup_window, holdout_keep=s.holdout_keep, retention_s=s.retention_s)
    tee = Tee(s, store, m, client_factory=tee_client_factory) if s.tee else None
    ups = Upstreams(Upstream(s.upstream.rstrip("/"), version, draft), m)
    admin = Admin(s, ups, m, store, tee, engines)
    return ProxyApp(s, ups, m, tee, admin)


def run(app: ProxyApp, s: ProxySettings) -> None:
    import uvicorn

    from server.connections import protocol_class

    http = protocol_class(s.http_header_timeout_s, s.max_connections)
    uvicorn.run(app, host=s.host, port=s.port, log_level="warning", http=http, lifespan="on",
                timeout_keep_alive=s.http_idle_timeout_s, server_header=False, date_header=False)  # fmt: skip
