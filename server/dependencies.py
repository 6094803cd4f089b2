"""What routes need, as FastAPI dependencies: the settings, the running services, the token check.

The services are built once by ``create_app`` and kept on ``app.state``; routes ask for them
with ``Depends`` instead of closing over locals, so each router is a plain module that tests
and readers can follow on its own.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from connector.contract.settings import Settings
from server.admission import Admitter
from server.delivery import DeliveryService
from server.ledger import Job, Ledger
from server.metrics import SidecarMetrics
from server.model_shape import SampleSizer
from server.notices import NoticeReceiver
from server.spool import SpoolKeeper
from server.submitter import Submitter
from server.tokenization import Tokenizer


@dataclass
class Services:
    """The sidecar's long-lived parts, built by ``create_app`` and started by its lifespan."""

    settings: Settings
    ledger: Ledger
    metrics: SidecarMetrics
    tokenizer: Tokenizer
    keeper: SpoolKeeper
    notices: NoticeReceiver
    delivery: DeliveryService
    submitter: Submitter
    sizer: SampleSizer  # bytes a sample takes on the spool (unknown until a config or the first notice)
    admitter: Admitter = field(default_factory=Admitter)  # jobs are tokenised and written off the event loop
    #: Requests refused before their body was read or while it came (``server/request_gate.py``,
    #: ``server/body_limit.py``): ``/v1/stats`` ``http``.
    http_stats: dict[str, int] = field(default_factory=dict)

    @property
    def spool(self) -> Path:
        return self.settings.spool_dir


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_settings(request: Request) -> Settings:
    return request.app.state.services.settings


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def has_token(request: Request, settings: Settings) -> bool:
    """Whether the request carries the bearer token (always, when none is set).

    ``secrets.compare_digest`` keeps the comparison's time independent of how much of the
    token a caller got right."""
    if not settings.api_token:
        return True
    got = request.headers.get("authorization", "")
    return secrets.compare_digest(got.encode(), f"Bearer {settings.api_token}".encode())


def require_token(request: Request, settings: SettingsDep) -> None:
    """Bearer-token check, applied per router (every route but the health probes)."""
    if not has_token(request, settings):
        raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer $HSSTREAM_API_TOKEN)")


def job_or_404(job_id: str, svc: ServicesDep) -> Job:
    j = svc.ledger.job_view(job_id)  # a live job, or the summary of a compacted one
    if j is None:
        raise HTTPException(404, f"unknown job {job_id!r}")
    return j
