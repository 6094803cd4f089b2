"""The sidecar: REST in front, vLLM behind, notices in, trainers served.

Run with ``hsstream serve`` (or ``uvicorn server.app:create_app --factory``). It binds both
ZeroMQ endpoints (connectors and trainers only ever connect), so vLLM engines and trainers
can restart without reconfiguration; its ledger is on disk, so it can restart too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, File, Form, HTTPException, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from connector import protocol as P
from connector.settings import Settings
from server.delivery import CurveServer, DeliveryService
from server.ledger import Ledger, NewSample
from server.metrics import SidecarMetrics
from server.notices import NoticeReceiver
from server.schemas import JobCreated, JobIn, JobOptions, JobStatus, SampleError, SampleIn, TokenCounts
from server.spool import SpoolKeeper
from server.submitter import Submitter, VllmUnavailable
from server.tokenization import SampleRejected, Tokenizer

log = logging.getLogger("hsstream.sidecar")


def _model_shape(model_dir: str | None, layer_ids: list[int]) -> tuple[tuple[int, int, int], int | None]:
    """((layers, hidden, dtype size), max_model_len) from the verifier's config, for the budget."""
    if not model_dir or not os.path.isdir(model_dir):
        return (0, 0, 0), None
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    h = int(cfg.get("hidden_size", 0))
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return (max(1, len(layer_ids)), h, P.DTYPE_SIZES.get(dt, 2)), cfg.get("max_position_embeddings")


def check_spool_dir(spool) -> None:  # noqa: ANN001
    """The reaper deletes unowned *.safetensors in the spool: it must be ours alone. A symlink
    (e.g. planted in the world-writable /dev/shm) could point it at model weights."""
    spool.mkdir(parents=True, exist_ok=True, mode=0o755)
    st = os.lstat(spool)
    import stat as st_mod

    if not st_mod.S_ISDIR(st.st_mode):
        raise RuntimeError(f"spool {spool} is not a plain directory (a symlink?): refusing to manage it")
    if st.st_uid != os.getuid() or st.st_mode & 0o002:
        raise RuntimeError(
            f"spool {spool} must belong to this user and not be world-writable (mode {oct(st.st_mode & 0o777)})"
        )


def _curve(s: Settings) -> CurveServer | None:
    if not s.remote_endpoint:
        return None
    if not (s.curve_server_secret_file and s.curve_clients_dir):
        raise ValueError(
            "HSSTREAM_REMOTE_ENDPOINT needs HSSTREAM_CURVE_SERVER_SECRET_FILE and HSSTREAM_CURVE_CLIENTS_DIR "
            "(create them with `hsstream keys DIR`)"
        )
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(s.curve_server_secret_file))
    if secret is None:
        raise ValueError(f"{s.curve_server_secret_file} holds no secret key")
    return CurveServer(public, secret, str(s.curve_clients_dir))


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or Settings()
    spool = s.spool_dir
    s.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ledger = Ledger(s.ledger_file(), max_attempts=s.max_attempts)
    metrics = SidecarMetrics(ledger)
    shape, max_len = _model_shape(s.model, s.layer_ids)
    tokenizer = Tokenizer(s.model or None, max_model_len=max_len)
    keeper = SpoolKeeper(spool, ledger)
    notices = NoticeReceiver(s.notice_ep(), spool, ledger)
    delivery = DeliveryService(
        s.delivery_ep(), spool, ledger, peer_timeout_s=s.trainer_timeout_s,
        remote_endpoint=s.remote_endpoint, curve=_curve(s),
    )  # fmt: skip
    submitter = Submitter(
        ledger, s.vllm_url, budget_bytes=s.spool_budget_bytes, max_ready=s.max_ready_samples,
        concurrency=s.max_concurrency, timeout_s=s.request_timeout_s, down_deadline_s=s.vllm_down_deadline_s,
        notice_timeout_s=s.notice_timeout_s, spool_dir=str(spool),
    )  # fmt: skip
    submitter.on_latency = metrics.request_latency.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        check_spool_dir(spool)
        rec = ledger.recover(keeper.exists)
        removed = keeper.sweep(min_age_s=0)
        if rec or removed:
            log.info("recovered ledger %s: %s; removed %d stray spool files", s.ledger_file(), rec, removed)
        notices.start()
        delivery.start()
        await submitter.start()
        reaper = asyncio.create_task(keeper.run())
        log.info("sidecar up: spool %s, notices %s, delivery %s", spool, s.notice_ep(), s.delivery_ep())
        yield
        reaper.cancel()
        await submitter.stop()
        delivery.stop()
        notices.stop()
        ledger.close()

    app = FastAPI(title="hsstream sidecar", version=str(P.PROTOCOL_VERSION), lifespan=lifespan)
    app.state.ledger, app.state.notices, app.state.delivery, app.state.submitter = ledger, notices, delivery, submitter

    @app.middleware("http")
    async def limit_body(request: Request, call_next):  # noqa: ANN001, ANN202
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > s.max_body_bytes:
            return JSONResponse({"detail": f"request body of {int(n):,} bytes exceeds the limit of "
                                           f"{s.max_body_bytes:,} (HSSTREAM_MAX_BODY_BYTES)"}, status_code=413)  # fmt: skip
        return await call_next(request)

    def auth(request: Request) -> None:
        if s.api_token and request.headers.get("authorization") != f"Bearer {s.api_token}":
            raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer $HSSTREAM_API_TOKEN)")

    def job_or_404(job_id: str):  # noqa: ANN202
        j = ledger.jobs.get(job_id)
        if j is None:
            raise HTTPException(404, f"unknown job {job_id!r}")
        return j

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
        if not ledger.is_open():
            problems.append(f"ledger {s.ledger_file()} not open")
        for name, alive in (("notice", notices.alive), ("delivery", delivery.alive), ("submitter", submitter.alive)):
            if not alive():
                problems.append(f"{name} loop is not running (see the sidecar log)")
        if problems:
            return JSONResponse({"ready": False, "problems": problems}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def prom() -> Response:
        body, ctype = metrics.render(spool)
        return Response(body, media_type=ctype)

    def admit(samples: list[SampleIn], opt: JobOptions) -> JobCreated:
        rows, bad = [], []
        for i, smp in enumerate(samples):
            try:
                t = tokenizer(smp, opt)
            except SampleRejected as e:
                bad.append({"index": i, "id": smp.id, "reason": str(e)})
                continue
            n_pos = len(t.token_ids) + (opt.sampling.max_tokens if opt.mode == "regenerate" else 0)
            nbytes = P.expected_file_bytes(n_pos, *shape) if shape[1] else 0
            if nbytes > s.spool_budget_bytes:
                bad.append({"index": i, "id": smp.id, "reason": f"sample needs {nbytes:,} spool bytes, more than the "
                            f"whole spool budget of {s.spool_budget_bytes:,} (HSSTREAM_SPOOL_BUDGET_BYTES)"})  # fmt: skip
                continue
            rows.append(NewSample(t.token_ids, t.loss_mask, t.label, nbytes))
        if bad and opt.on_invalid == "reject":
            raise HTTPException(422, {"message": f"{len(bad)} invalid sample(s); nothing was queued", "samples": bad})
        if not rows:
            raise HTTPException(422, {"message": "no valid sample in the job", "samples": bad})
        sampling = opt.sampling.model_dump() if opt.mode == "regenerate" else None
        created = ledger.add_job(rows, epochs=opt.epochs, seed=opt.seed, sampling=sampling,
                                 meta={"options": opt.model_dump(), "rejected": bad})  # fmt: skip
        submitter.wake()
        return JobCreated(job_id=created.job_id, num_samples=len(created.samples), num_failed_at_submission=len(bad))

    @app.post("/v1/jobs", response_model=JobCreated, dependencies=[Depends(auth)])
    async def create_job(job: JobIn) -> JobCreated:
        return admit(job.samples, job.options)

    @app.post("/v1/jobs/upload", response_model=JobCreated, dependencies=[Depends(auth)])
    async def upload_job(file: UploadFile = File(...), options: str = Form("{}")) -> JobCreated:  # noqa: B008
        """The same records as ``POST /v1/jobs``, one JSON object per line."""
        try:
            opt = JobOptions.model_validate_json(options)
        except ValidationError as e:
            raise HTTPException(422, {"message": "bad options", "errors": json.loads(e.json())}) from e
        samples, bad = [], []
        for ln, line in enumerate((await file.read()).decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                samples.append(SampleIn.model_validate_json(line))
            except ValidationError as e:
                bad.append({"line": ln, "reason": "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                            for x in e.errors())})  # fmt: skip
        if bad:
            raise HTTPException(422, {"message": f"{len(bad)} bad line(s) in {file.filename}", "lines": bad[:100]})
        if not samples:
            raise HTTPException(422, {"message": f"{file.filename} holds no records"})
        return admit(samples, opt)

    @app.get("/v1/jobs", dependencies=[Depends(auth)])
    async def list_jobs() -> list[dict]:
        return [{"job_id": j.job_id, "done": j.done, "counts": j.counts()} for j in ledger.jobs.values()]

    @app.get("/v1/jobs/{job_id}", response_model=JobStatus, dependencies=[Depends(auth)])
    async def job_status(job_id: str, errors_offset: int = Query(0, ge=0), errors_limit: int = Query(100, ge=1, le=1000)):  # noqa: ANN201
        j = job_or_404(job_id)
        elapsed = (j.finished or time.time()) - j.created
        with_err = [x for x in j.samples if x.errors]
        page = with_err[errors_offset : errors_offset + errors_limit]
        return JobStatus(
            job_id=j.job_id, done=j.done, counts=j.counts(), num_samples=len(j.samples),
            tokens_consumed=j.tokens_consumed, bytes_consumed=j.bytes_consumed, elapsed_s=round(elapsed, 3),
            tokens_per_s=round(j.tokens_consumed / elapsed, 1) if elapsed > 0 else 0.0,
            errors=[SampleError(index=x.key.index, label=x.label, errors=x.errors) for x in page],
            errors_total=len(with_err), errors_offset=errors_offset,
        )  # fmt: skip

    @app.get("/v1/jobs/{job_id}/token_counts", response_model=TokenCounts, dependencies=[Depends(auth)])
    async def token_counts(job_id: str) -> TokenCounts:
        j = job_or_404(job_id)
        c: Counter[int] = Counter()
        total = 0
        for x in j.samples:
            if x.key.epoch != 0:
                continue
            mask = x.loss_mask or [1] * len(x.token_ids)
            c.update(t for t, m in zip(x.token_ids, mask, strict=False) if m)
            total += len(x.token_ids)
        return TokenCounts(job_id=job_id, vocab_size=tokenizer.vocab_size, total_tokens=total, counts=dict(c))

    @app.delete("/v1/jobs/{job_id}", dependencies=[Depends(auth)])
    async def cancel_job(job_id: str) -> dict:
        job_or_404(job_id)
        files = ledger.cancel_job(job_id)
        aborted = await submitter.cancel_job(job_id)
        removed = keeper.remove(files)
        return {"job_id": job_id, "cancelled": True, "aborted_requests": aborted, "removed_files": removed,
                "counts": ledger.jobs[job_id].counts()}  # fmt: skip

    @app.get("/v1/stats", dependencies=[Depends(auth)])
    async def stats() -> dict:
        return {
            "reserved_bytes": ledger.reserved_bytes,
            "budget_bytes": s.spool_budget_bytes,
            "spool_file_bytes": keeper.file_bytes(),
            "ready": ledger.ready_count(),
            "vllm_down_since_s": None if submitter.down_since is None else round(time.monotonic() - submitter.down_since, 1),
            "notices": notices.stats,
            "delivery": delivery.stats,
            "submitter": submitter.stats,
            "states": dict(Counter(x.state.value for j in ledger.jobs.values() for x in j.samples)),
        }
    return app
