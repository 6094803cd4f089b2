"""Prometheus metrics and the JSON stats: both reveal workload details, so both need the token.

What takes the ledger's lock is read through ``server/ledger_calls.py``: never waiting for it on
the event loop."""

from __future__ import annotations

import time
from collections import Counter

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from connector.contract.rest import ArenaUsage, EngineInfo, Overview, SampleSize, Stats
from server.dependencies import Services, ServicesDep, require_token
from server.ledger_calls import ledger_call
from server.overview import overview

router = APIRouter(tags=["observability"], dependencies=[Depends(require_token)])


@router.get("/metrics")
async def prom(svc: ServicesDep) -> Response:
    body, ctype = await ledger_call(svc.ledger, svc.metrics.render, svc.spool)
    return Response(body, media_type=ctype)


@router.get("/v1/stats", response_model=Stats, response_model_exclude_unset=True)  # unset: a size not yet known
async def stats(svc: ServicesDep) -> Stats:
    return await ledger_call(svc.ledger, _stats, svc)


def _stats(svc: Services) -> Stats:
    ledger, sub = svc.ledger, svc.submitter
    return Stats(
        reserved_bytes=ledger.reserved_bytes,
        budget_bytes=svc.settings.spool_budget_bytes,
        sample_size=SampleSize(**svc.sizer.describe()),
        engine_max_model_len=sub.engine_max_len,
        spool_file_bytes=svc.keeper.file_bytes(),
        ready=ledger.ready_count(),
        vllm_down_since_s=None if sub.down_since is None else round(time.monotonic() - sub.down_since, 1),
        engines=[EngineInfo(**e.describe()) for e in sub.engines],
        notices=svc.notices.stats,
        delivery=svc.delivery.stats,
        submitter=sub.stats,
        states=dict(sum((Counter(j.counts()) for j in list(ledger.jobs.values())), Counter())),
        in_flight=ledger.in_flight(),
        spool_layout=svc.settings.spool_layout,
        arena=ArenaUsage(**vars(a)) if (a := ledger.arena_stats()) is not None else None,
        trainers=svc.delivery.trainers(),
        http=dict(svc.http_stats),
        ledger_unsaved=ledger.unsaved()[0],
    )


@router.get("/v1/overview", response_model=Overview)
async def get_overview(svc: ServicesDep) -> Overview:
    """Jobs, consumption rates, spool against budget and connected trainers, in one snapshot
    (what ``hsstream top`` shows)."""
    return await ledger_call(svc.ledger, overview, svc)
