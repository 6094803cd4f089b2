"""The sidecar: REST in front, vLLM behind, notices in, trainers served.

Run with ``hsstream serve`` (or ``uvicorn server.app:create_app --factory``). ``create_app`` builds
the long-lived services and wires the routers (``server/routers``); routes reach the services and
the token check through ``server/dependencies.py``. It binds both
ZeroMQ endpoints (connectors and trainers only ever connect), so vLLM engines and trainers
can restart without reconfiguration; its ledger is on disk, so it can restart too.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from contextlib import asynccontextmanager

from fastapi import FastAPI

from connector import protocol as P
from connector import layouts as L
from connector.contract.api_token import ensure_token
from connector.contract.rest import JobIn
from connector.contract.settings import Settings, lower_switch_interval
from connector.transport import senders_from_settings
from server import errors
from server.body_limit import BodyLimit
from server.delivery import CurveServer, DeliveryService
from server.dependencies import Services
from server.doorbell import Doorbell
from server.instance_lock import acquire
from server.ledger import Ledger
from server.metrics import SidecarMetrics
from server.model_shape import SampleSizer
from server.notices import NoticeReceiver
from server.request_gate import RequestGate
from server.routers import docs, health, jobs, observability
from server.spool import SpoolKeeper
from server.submitter import Submitter
from server.tokenization import Tokenizer

log = logging.getLogger("hsstream.sidecar")


def _curve(s: Settings) -> CurveServer | None:
    if not s.remote_endpoint:
        return None
    if not (s.curve_server_secret_file and s.curve_clients_dir):
        raise ValueError(
            "HSSTREAM_REMOTE_ENDPOINT needs HSSTREAM_CURVE_SERVER_SECRET_FILE and HSSTREAM_CURVE_CLIENTS_DIR "
            "(create them with `hsstream keys DIR`)"
        )
    from connector.contract.curve_keys import load_secret

    public, secret = load_secret(s.curve_server_secret_file)  # refuses a file others can read
    if secret is None:
        raise ValueError(f"{s.curve_server_secret_file} holds no secret key")
    return CurveServer(public, secret, str(s.curve_clients_dir))


def offer_transports(delivery: DeliveryService, s: Settings) -> None:
    """Every registered transport the settings configure (``connector/transport/``), each
    with its delivery counter; a sender that cannot start stops the sidecar with the reason."""
    for name, sender in senders_from_settings(s).items():
        delivery.senders[name] = sender
        delivery.stats.setdefault(f"delivered_{name}", 0)


async def compact_finished_jobs(ledger: Ledger, retention_s: float) -> None:
    """Finished jobs keep their rows for the retention, then only a summary (bounded disk)."""
    while True:
        await asyncio.sleep(min(60.0, max(1.0, retention_s / 4)))
        try:
            gone = await asyncio.to_thread(ledger.compact, retention_s)
            if gone:
                log.info("compacted %d finished job(s): %s", len(gone), ", ".join(gone))
        except Exception:  # noqa: BLE001 - compaction must outlive one failure
            log.exception("job compaction failed")


def create_app(settings: Settings | None = None, *, rest: str | None = None) -> FastAPI:
    """``rest``: the address the REST API is served at (for the lock files: the next sidecar's
    error names it), else ``HSSTREAM_HOST``:``HSSTREAM_PORT``."""
    s = settings or Settings()
    spool = s.spool_dir
    if P.claim_spool(spool):  # refuses a directory that is not ours (e.g. a model folder), before anything
        log.info("spool %s created/marked as ours", spool)
    s.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Before the ledger is opened (and migrated), the arena adopted, the spool swept or a socket
    # bound: another live sidecar on any of them stops this one here (server/instance_lock.py).
    instance = acquire(s, rest=rest or f"http://{s.host}:{s.port}")
    try:
        return _create_app(s, instance)
    except BaseException:
        instance.release()
        raise


def _create_app(s: Settings, instance) -> FastAPI:  # noqa: ANN001
    spool = s.spool_dir
    if not s.api_token and not s.allow_open:
        # A token on loopback too (connector/contract/api_token.py): ours, in the run dir, 0600.
        s = s.model_copy(update={"api_token": ensure_token(s.run_dir)})
        log.info("REST API token: the one in %s (HSSTREAM_API_TOKEN unset)", s.run_dir / "api-token")
    ledger = Ledger(s.ledger_file(), max_attempts=s.max_attempts)
    # The spool layout's sidecar half (connector/layouts/): for the arena, one shared-memory file
    # of the budget's size, kept across restarts when the size is unchanged, and the ledger's
    # allocator of its slots (the ledger's rows hold them: recover rebuilds).
    layout = L.sidecar_from_settings(s)
    layout.open(spool, s, ledger)
    sizer, max_len = SampleSizer.for_model(s.model, s.layer_ids, s.payload_dtype)
    metrics = SidecarMetrics(ledger)  # a ledger listener: counts every move, on the thread that made it
    tokenizer = Tokenizer(s.model or None, max_model_len=max_len)
    # The hand-offs between threads, all made here. The delivery thread sleeps on its doorbell;
    # the notices thread rings it after a commit that made samples READY, the submitter (event
    # loop) when vLLM's reply did (regenerate mode). REST routes wake the submitter
    # (Submitter.wake) when a job comes or goes; the submitter keeps its count of SUBMITTED
    # samples as a ledger listener.
    delivery_bell = Doorbell()
    svc = Services(
        settings=s, ledger=ledger, metrics=metrics, sizer=sizer, tokenizer=tokenizer,
        keeper=SpoolKeeper(spool, ledger),
        notices=NoticeReceiver(
            s.notice_ep(), spool, ledger, max_message_bytes=s.max_peer_message_bytes,
            observe=sizer.learn,  # the sample size, from the first notice when no config was readable
            wake_delivery=delivery_bell.ring,
        ),
        delivery=DeliveryService(
            s.delivery_ep(), spool, ledger, peer_timeout_s=s.trainer_timeout_s,
            remote_endpoint=s.remote_endpoint, curve=_curve(s),
            max_credit=s.max_trainer_credit, send_hwm=s.trainer_send_hwm,
            max_message_bytes=s.max_peer_message_bytes, max_hello_jobs=s.max_hello_jobs,
            doorbell=delivery_bell,
            on_unheld=metrics.count_unheld,  # settlements without their lease token
            layout=layout, max_settle_keys=s.max_settle_keys,
            budget_bytes=s.spool_budget_bytes,  # shared by the trainers: none pins what the others need
        ),
        submitter=Submitter(
            ledger, s.vllm_url, budget_bytes=s.spool_budget_bytes, max_ready=s.max_ready_samples,
            concurrency=s.max_concurrency, timeout_s=s.request_timeout_s, down_deadline_s=s.vllm_down_deadline_s,
            notice_timeout_s=s.notice_timeout_s, spool_dir=str(spool), sizer=sizer,
            on_latency=metrics.request_latency.observe,
            on_engine_limit=tokenizer.set_engine_limit,  # vLLM's max_model_len, once it answers
            wake_delivery=delivery_bell.ring,
        ),
    )  # fmt: skip
    offer_transports(svc.delivery, s)
    metrics.trainers.source = svc.delivery.trainers  # read at each scrape, a snapshot of its peers

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        rec = ledger.recover(svc.keeper.exists)
        removed = svc.keeper.sweep(min_age_s=0)
        if rec or removed:
            log.info("recovered ledger %s: %s; removed %d stray spool files", s.ledger_file(), rec, removed)
        lower_switch_interval(s.switch_interval_ms)  # the notice and delivery threads' latency
        svc.notices.start()
        svc.delivery.start()
        await svc.submitter.start()
        reaper = asyncio.create_task(svc.keeper.run())
        compactor = asyncio.create_task(compact_finished_jobs(ledger, s.job_retention_s))
        log.info("sidecar up: spool %s, notices %s, delivery %s", spool, s.notice_ep(), s.delivery_ep())
        yield
        reaper.cancel()
        compactor.cancel()
        await svc.submitter.stop()
        svc.delivery.stop()
        svc.notices.stop()
        svc.admitter.close()
        ledger.close()
        instance.release()

    app = FastAPI(title="hsstream sidecar", version=str(P.PROTOCOL_VERSION), lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None,  # served by routers/docs.py, behind the token
                  default_response_class=errors.AsciiJSONResponse)  # fmt: skip
    errors.install(app)
    app.state.services = svc

    # Outermost last: the gate (the token, one client's bodies) answers from the request's head,
    # before the body limits count a byte and before FastAPI reads or parses any.
    app.add_middleware(BodyLimit, json_bytes=s.max_json_bytes, upload_bytes=s.max_body_bytes,
                       body_timeout_s=s.http_body_timeout_s, stats=svc.http_stats)  # fmt: skip
    app.add_middleware(RequestGate, token=s.api_token or None, uploads_per_client=s.max_uploads_per_client,
                       stats=svc.http_stats)  # fmt: skip
    weakref.finalize(app, instance.release)  # an app never started (a test's) lets its locks go with it

    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(observability.router)
    app.include_router(docs.router)
    docs.add_request_bodies(app, JobIn)  # POST /v1/jobs reads its body itself (off the event loop)
    return app
