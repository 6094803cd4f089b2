"""The sidecar: REST in front, vLLM behind, notices in, trainers served.

Run with ``hsstream serve`` (or ``uvicorn server.app:create_app --factory``). It binds both
ZeroMQ endpoints (connectors and trainers only ever connect), so vLLM engines and trainers
can restart without reconfiguration.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from connector import protocol as P
from connector.settings import Settings
from server.delivery import DeliveryService
from server.ledger import Ledger
from server.notices import NoticeReceiver
from server.schemas import JobCreated, JobIn, JobStatus, SampleError
from server.submitter import Submitter, VllmUnavailable
from server.tokenization import SampleRejected, Tokenizer

log = logging.getLogger("hsstream.sidecar")


def _model_shape(model_dir: str | None, layer_ids: list[int]) -> tuple[int, int, int | None]:
    """(bytes per token, hidden size, max_model_len) from the verifier's config, for budgets."""
    if not model_dir or not os.path.isdir(model_dir):
        return 0, 0, None
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h = int(cfg.get("hidden_size", 0))
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    per_tok = P.expected_nbytes(1, max(1, len(layer_ids)), h, P.DTYPE_SIZES.get(dt, 2))
    return per_tok, h, cfg.get("max_position_embeddings")


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or Settings()
    spool = s.spool_dir
    ledger = Ledger(max_attempts=s.max_attempts)
    per_token, _, max_len = _model_shape(s.model, s.layer_ids)
    tokenizer = Tokenizer(s.model or None, max_model_len=max_len)
    notices = NoticeReceiver(s.notice_ep(), spool, ledger)
    delivery = DeliveryService(s.delivery_ep(), spool, ledger)
    submitter = Submitter(
        ledger, s.vllm_url, budget_bytes=s.spool_budget_bytes, concurrency=s.max_concurrency, timeout_s=s.request_timeout_s
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        spool.mkdir(parents=True, exist_ok=True)
        notices.start()
        delivery.start()
        await submitter.start()
        log.info("sidecar up: spool %s, notices %s, delivery %s", spool, s.notice_ep(), s.delivery_ep())
        yield
        await submitter.stop()
        delivery.stop()
        notices.stop()

    app = FastAPI(title="hsstream sidecar", version=str(P.PROTOCOL_VERSION), lifespan=lifespan)
    app.state.ledger, app.state.notices, app.state.delivery, app.state.submitter = ledger, notices, delivery, submitter

    def auth(request: Request) -> None:
        if s.api_token and request.headers.get("authorization") != f"Bearer {s.api_token}":
            raise HTTPException(401, "missing or wrong bearer token")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        problems = []
        try:
            await submitter.vllm_model()
        except VllmUnavailable as e:
            problems.append(str(e))
        if not os.access(spool, os.W_OK):
            problems.append(f"spool {spool} not writable")
        if problems:
            return JSONResponse({"ready": False, "problems": problems}, status_code=503)
        return JSONResponse({"ready": True})

    @app.post("/v1/jobs", response_model=JobCreated, dependencies=[Depends(auth)])
    async def create_job(job: JobIn) -> JobCreated:
        rows, bad = [], []
        for i, smp in enumerate(job.samples):
            try:
                t = tokenizer(smp, job.options)
            except SampleRejected as e:
                bad.append({"index": i, "id": smp.id, "reason": str(e)})
                continue
            rows.append((t.token_ids, t.loss_mask, t.label, per_token * len(t.token_ids)))
        if bad and job.options.on_invalid == "reject":
            raise HTTPException(422, {"message": f"{len(bad)} invalid sample(s); nothing was queued", "samples": bad})
        if not rows:
            raise HTTPException(422, {"message": "no valid sample in the job", "samples": bad})
        created = ledger.add_job(rows)
        submitter.wake()
        return JobCreated(job_id=created.job_id, num_samples=len(rows), num_failed_at_submission=len(bad))

    @app.get("/v1/jobs", dependencies=[Depends(auth)])
    async def list_jobs() -> list[dict]:
        return [{"job_id": j.job_id, "done": j.done, "counts": j.counts()} for j in ledger.jobs.values()]

    @app.get("/v1/jobs/{job_id}", response_model=JobStatus, dependencies=[Depends(auth)])
    async def job_status(job_id: str) -> JobStatus:
        j = ledger.jobs.get(job_id)
        if j is None:
            raise HTTPException(404, f"unknown job {job_id!r}")
        elapsed = (j.finished or time.time()) - j.created
        errs = [SampleError(index=x.key.index, label=x.label, errors=x.errors) for x in j.samples if x.errors][:100]
        return JobStatus(
            job_id=j.job_id,
            done=j.done,
            counts=j.counts(),
            num_samples=len(j.samples),
            tokens_consumed=j.tokens_consumed,
            elapsed_s=round(elapsed, 3),
            tokens_per_s=round(j.tokens_consumed / elapsed, 1) if elapsed > 0 else 0.0,
            errors=errs,
        )

    @app.get("/v1/stats", dependencies=[Depends(auth)])
    async def stats() -> dict:
        usage = shutil.disk_usage(spool)
        return {
            "reserved_bytes": ledger.reserved_bytes,
            "budget_bytes": s.spool_budget_bytes,
            "spool_used_bytes": usage.used,
            "notices": notices.stats,
            "delivery": delivery.stats,
            "submitter": submitter.stats,
        }

    return app
