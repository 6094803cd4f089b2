"""The serving proxy's settings (``HSSTREAM_PROXY_*``): where it listens, the vLLM it fronts, its
keys, and what it tees into the sidecar's traffic jobs.

A role of its own, like the sidecar's settings in ``connector/contract/settings.py``, but read by
the proxy and the ``hsstream proxy`` commands only, so they live beside them; the sidecar's
address and token come from the shared settings (``HSSTREAM_HOST``/``PORT``, and
``SidecarClient``'s own token lookup).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_state_dir() -> Path:
    from connector.contract.settings import Settings

    return Path(Settings().state_dir) / "proxy"


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HSSTREAM_PROXY_", extra="ignore")

    # ------------------------------------------------------------------ serving
    host: str = "127.0.0.1"
    port: int = 8200
    #: The serving vLLM (the user's, running the current draft with --speculative-config). In
    #: managed mode (``hsstream proxy serve --model``) the proxy starts it itself.
    upstream: str = "http://127.0.0.1:8000"
    #: The proxy's own key: clients send ``Authorization: Bearer KEY``. Unset: the client's
    #: Authorization goes to vLLM unchanged (vLLM's --api-key then checks it).
    api_key: str | None = None
    #: vLLM's --api-key, sent to vLLM in place of the proxy's key (only with ``api_key`` set).
    upstream_api_key: str | None = None
    #: For ``/admin/*`` (swap, rollback, held-out slice, forget). Unset: a token generated into
    #: ``state_dir/admin.token`` (0600) at start, which the ``hsstream proxy`` commands read.
    admin_token: str | None = None
    max_body_bytes: int = Field(default=32 * 2**20, ge=1024)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    #: Longest silence between two reads from vLLM (a long generation streams; a non-streamed one
    #: is silent until it ends, so this bounds a non-streamed request's whole time).
    read_timeout_s: float = Field(default=600.0, gt=0)
    #: Idle pooled connections to vLLM are closed after this long: below vLLM's own keep-alive
    #: (uvicorn's 5 s), so the proxy never sends a request on a connection vLLM is closing.
    upstream_keepalive_s: float = Field(default=4.0, gt=0)
    max_connections: int = Field(default=1024, ge=1)
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_idle_timeout_s: float = Field(default=5.0, gt=0)

    # ------------------------------------------------------------------ the tee
    #: Tee finished requests into the sidecar at all (off: a plain proxy).
    tee: bool = True
    #: The sidecar's REST URL (default ``http://HSSTREAM_HOST:HSSTREAM_PORT``).
    sidecar_url: str | None = None
    #: A request carrying this header (any value but 0/false/no/off) is never teed.
    private_header: str = "x-hsstream-private"
    #: Share of finished requests teed (drawn per request before its reply is buffered).
    sample_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    #: Teed samples per minute at most (a sliding minute); the rest are counted and dropped.
    max_per_minute: int = Field(default=600, ge=0)
    #: A request and its reply bigger than this are not buffered for the tee.
    max_tee_bytes: int = Field(default=4 * 2**20, ge=1024)
    #: Requests waiting for the tee's thread, and their bytes: past either the newest is dropped.
    queue_max: int = Field(default=1024, ge=1)
    queue_max_bytes: int = Field(default=64 * 2**20, ge=1024)
    #: A traffic job is sent every ``flush_s`` seconds or ``flush_samples`` samples.
    flush_s: float = Field(default=5.0, gt=0)
    flush_samples: int = Field(default=64, ge=1)
    #: Samples the sidecar holds queued beyond which a batch is dropped (a trainer that does not
    #: keep up, a full spool): the backlog stays bounded and the client never waits.
    max_backlog: int = Field(default=4096, ge=0)
    #: Content hashes remembered for de-duplication (the newest; also kept across restarts).
    dedup_window: int = Field(default=100_000, ge=1)
    #: Share of teed requests held out of training for the swap's gate (by content hash and
    #: ``holdout_seed``), kept in the proxy's store, the newest ``holdout_keep``.
    holdout_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    holdout_seed: int = 0
    holdout_keep: int = Field(default=256, ge=1)
    #: How long the proxy keeps what it stored (hashes, held-out conversations, the traffic job
    #: ids), and after which it cancels a traffic job the trainer never took.
    retention_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    #: The proxy's own files: ``teed.sqlite`` (0600) and ``admin.token``.
    state_dir: Path = Field(default_factory=_default_state_dir)

    @field_validator("private_header")
    @classmethod
    def _header_name(cls, v: str) -> str:
        v = v.strip().lower()
        if not v or any(c in v for c in " :\r\n\t"):
            raise ValueError(f"not an HTTP header name: {v!r}")
        return v

    def sidecar(self) -> str:
        if self.sidecar_url:
            return self.sidecar_url.rstrip("/")
        from connector.contract.settings import Settings

        s = Settings()
        return f"http://{s.host}:{s.port}"

    def store_path(self) -> Path:
        return self.state_dir / "teed.sqlite"

    def admin_token_file(self) -> Path:
        return self.state_dir / "admin.token"

    def resolved_admin_token(self, create: bool = False) -> str | None:
        """``admin_token``, else the one in ``state_dir/admin.token`` (made, 0600, if ``create``)."""
        if self.admin_token:
            return self.admin_token
        p = self.admin_token_file()
        if p.is_file():
            return p.read_text().strip() or None
        if not create:
            return None
        import secrets

        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tok = secrets.token_hex(24)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(tok + "\n")
        return tok
