"""Liveness and readiness probes: open, so orchestrators need no credentials."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from server.dependencies import ServicesDep
from server.submitter import VllmUnavailable

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"ok": True}


@router.get("/readyz")
async def readyz(svc: ServicesDep) -> JSONResponse:
    problems = []
    try:
        await svc.submitter.vllm_model()
    except VllmUnavailable as e:
        problems.append(str(e))
    if not os.access(svc.spool, os.W_OK):
        problems.append(f"spool {svc.spool} not writable")
    if not svc.ledger.is_open():
        problems.append(f"ledger {svc.settings.ledger_file()} not open")
    loops = (("notice", svc.notices.alive), ("delivery", svc.delivery.alive), ("submitter", svc.submitter.alive))
    for name, alive in loops:
        if not alive():
            problems.append(f"{name} loop is not running (see the sidecar log)")
    if problems:
        return JSONResponse({"ready": False, "problems": problems}, status_code=503)
    return JSONResponse({"ready": True})
