"""Liveness and readiness probes: open, so orchestrators need no credentials.

``/readyz`` tells anyone whether the sidecar is ready; what is wrong (vLLM's URL, the spool's
and the ledger's paths, error text) only to holders of the token, as that is more than an
unauthenticated peer needs to know about the host."""

from __future__ import annotations

import os
import time

from fastapi import APIRouter, Request, Response

from connector.contract.rest import Health, Readiness
from server.dependencies import ServicesDep, has_token
from server.ledger_calls import ledger_call
from server.submitter import VllmUnavailable

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    return Health(ok=True)


@router.get("/readyz", response_model=Readiness, response_model_exclude_none=True,
            responses={503: {"model": Readiness, "description": "not ready"}})  # fmt: skip
async def readyz(request: Request, response: Response, svc: ServicesDep) -> Readiness:
    problems = []
    try:
        await svc.submitter.vllm_model()
    except VllmUnavailable as e:
        problems.append(str(e))
    if not os.access(svc.spool, os.W_OK):
        problems.append(f"spool {svc.spool} not writable")
    if not await ledger_call(svc.ledger, svc.ledger.is_open):
        problems.append(f"ledger {svc.settings.ledger_file()} not open")
    n, since, error = svc.ledger.unsaved()
    if n:
        problems.append(f"ledger {svc.settings.ledger_file()} cannot write ({error}): {n} row(s) wait since "
                        f"{time.strftime('%H:%M:%S', time.localtime(since or time.time()))}; nothing new is submitted "
                        "or delivered until the volume takes them")  # fmt: skip
    if problem := notices_stopped(svc):
        problems.append(problem)
    loops = (("notice", svc.notices.alive), ("delivery", svc.delivery.alive), ("submitter", svc.submitter.alive))
    for name, alive in loops:
        if not alive():
            problems.append(f"{name} loop is not running (see the sidecar log)")
    if problems:
        response.status_code = 503
        return Readiness(ready=False, problems=problems if has_token(request, svc.settings) else None)
    return Readiness(ready=True)


def notices_stopped(svc: ServicesDep) -> str | None:
    """Notices stopped: a sample's notice timed out and no notice has come since.

    Seen from the sidecar, so it covers every cause (the connector's notice thread gave up,
    vLLM runs without our connector, a wrong notice endpoint); it clears with the next notice."""
    timed_out, heard = svc.submitter.last_notice_timeout_at, svc.notices.last_notice_at
    if timed_out is None or (heard is not None and heard > timed_out):
        return None
    return (
        f"notices stopped: a sample vLLM answered got no notice within HSSTREAM_NOTICE_TIMEOUT_S "
        f"({svc.settings.notice_timeout_s:.0f} s) and none has come since; check vLLM's log for the connector's "
        f"notice thread and that vLLM's notice endpoint is {svc.settings.notice_ep()}"
    )
