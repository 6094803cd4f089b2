"""What one message may cost the ledger, and that the event loop never waits for its lock (issue
40, item 3). The real delivery service and ledger (on a file); a real uvicorn for the routes.

Once, 12 token-less ACKs naming 233,196 real keys were checked row by row under the ledger's
lock, and ``GET /v1/jobs`` and ``/healthz`` waited 4.5 s behind them."""

from __future__ import annotations

import sqlite3
import threading
import time

import httpx
import pytest
import uvicorn

from connector import protocol as P
from connector.contract.settings import Settings
from hsstream.devstack import free_port
from server.app import create_app
from server.connections import protocol_class
from server.delivery import GROUP_KEYS, DeliveryService
from server.ledger import Ledger, NewSample

OWNER = b"Lflood"


def _ledger(tmp_path, n: int) -> tuple[Ledger, list[P.SampleKey]]:
    """``n`` queued samples (rows in SQLite only, as most of a big job's are)."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = ledger.add_job([NewSample([1, 2, 3] * 100, None, f"s{i}", 30) for i in range(n)])
    return ledger, [s.key for s in ledger.job_samples(job.job_id)]


def _service(tmp_path, ledger: Ledger, **kw) -> DeliveryService:
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    return DeliveryService(f"ipc://{tmp_path}/d.sock", spool, ledger, **kw)  # never bound: messages handed in


def _frames(msg) -> list[bytes]:  # noqa: ANN001
    return [OWNER[1:], *P.encode_msg(msg)]


class _Counting:
    """The ledger's connection, counting the statements run through it."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.selects = db, 0

    def execute(self, sql: str, *a):  # noqa: ANN002, ANN201
        self.selects += sql.lstrip().upper().startswith("SELECT")
        return self.db.execute(sql, *a)


def test_an_ack_or_received_naming_too_many_keys_is_refused_whole_and_counted(tmp_path):
    ledger, keys = _ledger(tmp_path, 3)
    tokens = []
    for _ in keys:
        s = ledger.next_to_submit(10**9)
        ledger.on_notice(P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt,
                                  file=f"hs-{s.key.index}.safetensors", num_tokens=3, nbytes=30), 30)  # fmt: skip
        tokens.append(ledger.lease_next(OWNER, None).lease_token)
    svc = _service(tmp_path, ledger, max_settle_keys=1024)
    fake = [P.SampleKey(job=keys[0].job, epoch=9, index=i) for i in range(1022)]
    svc._on_messages(b"L", [_frames(P.Ack(keys=keys + fake, tokens=tokens + ["x"] * 1022))])
    svc._on_messages(b"L", [_frames(P.Received(keys=keys + fake, tokens=tokens + ["x"] * 1022))])
    assert svc.stats["oversized_settlements"] == 2 and svc.stats["acked"] == 0
    assert [ledger.get(k).state.value for k in keys] == ["leased"] * 3  # not even its real keys
    svc._on_messages(b"L", [_frames(P.Ack(keys=keys, tokens=tokens))])  # within the limit: applied
    assert svc.stats["acked"] == 3


def test_each_list_is_checked_in_one_query(tmp_path):
    ledger, keys = _ledger(tmp_path, 1000)
    svc = _service(tmp_path, ledger)
    counting = _Counting(ledger._db)
    ledger._db = counting
    svc._on_messages(b"L", [_frames(P.Ack(keys=keys, tokens=["not-its-token"] * 1000)),
                            _frames(P.Received(keys=keys, tokens=["not-its-token"] * 1000))])  # fmt: skip
    assert svc.stats["unheld_acks"] == 1000 and svc.stats["unheld_receiveds"] == 1000
    assert counting.selects <= 2, counting.selects  # one per list, not a row load per key


class _HoldSpy:
    """The ledger's lock, timing each hold by the thread that takes it: from its outermost acquire
    to its release, in that thread's CPU seconds (``time.thread_time``), so a loaded machine
    that deschedules it does not count."""

    def __init__(self, lock) -> None:  # noqa: ANN001
        self.lock, self.depth, self.t0, self.holds = lock, 0, 0.0, []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self.lock.acquire(blocking, timeout):
            return False
        if self.depth == 0:
            self.t0 = time.thread_time()
        self.depth += 1
        return True

    def release(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.holds.append(time.thread_time() - self.t0)
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_flood_of_settlements_never_holds_the_ledger_lock_for_long(tmp_path):
    """200 ACKs of 1,024 real keys each (none held by the sender), read off the socket together:
    applied in groups of at most GROUP_KEYS keys, each checked with a query per list, so the lock
    is let go between groups and another thread (the notices, a route, the submitter) waits for
    a group, not the flood."""
    ledger, keys = _ledger(tmp_path, 2000)
    svc = _service(tmp_path, ledger)
    batch = [_frames(P.Ack(keys=[keys[(m * 1024 + i) % 2000] for i in range(1024)], tokens=["x"] * 1024))
             for m in range(200)]  # fmt: skip
    spy = ledger._lock = _HoldSpy(ledger._lock)
    svc._on_messages(b"L", batch)
    assert svc.stats["unheld_acks"] == 200 * 1024
    assert GROUP_KEYS <= 4096 and len(spy.holds) >= 200 * 1024 // GROUP_KEYS
    assert max(spy.holds) < 0.5, (max(spy.holds), sum(spy.holds))  # CPU seconds of one hold


class _SpyLock:
    """The ledger's lock, noting each time the event loop's thread waits for it (a blocking
    acquire while another thread holds it)."""

    def __init__(self, lock) -> None:  # noqa: ANN001
        self.lock, self.loop_thread, self.loop_waits = lock, None, 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        if threading.get_ident() == self.loop_thread:
            self.loop_waits += 1
        return self.lock.acquire(True, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@pytest.fixture
def served(tmp_path):
    """The sidecar's app on a real uvicorn in this process (no lifespan: no loops, no vLLM), its
    ledger's lock watched (:class:`_SpyLock`)."""
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 api_token="t")  # fmt: skip
    app = create_app(s)
    svc = app.state.services
    spy = svc.ledger._lock = _SpyLock(svc.ledger._lock)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                                           http=protocol_class(10.0, 64)))  # fmt: skip
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    spy.loop_thread = t.ident  # uvicorn's event loop runs on this thread
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(f"{url}/healthz", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    for e in svc.submitter.engines:  # /readyz: vLLM "answered"
        e.model_name = "verifier"
    yield url, svc, spy
    server.should_exit = True
    t.join(10)
    svc.ledger.close()


def test_no_route_waits_for_the_ledger_lock_on_the_event_loop(served):
    """Every route that reads the ledger, called while another thread holds its lock (a long
    transaction): none waits for it on the event loop's thread, and all answer once it is free.
    (Once ``GET /v1/jobs`` did, and ``/healthz`` waited with it.)"""
    url, svc, spy = served
    job = svc.ledger.add_job([NewSample([1, 2, 3], None, "a", 30)]).job_id
    auth = {"authorization": "Bearer t"}
    paths = ["/v1/jobs", f"/v1/jobs/{job}", "/v1/stats", "/v1/overview", "/metrics", "/readyz",
             f"/v1/jobs/{job}/samples", f"/v1/jobs/{job}/token_counts"]  # fmt: skip
    answers: dict[str, int] = {}

    def call(path: str) -> None:
        answers[path] = httpx.get(f"{url}{path}", headers=auth, timeout=60).status_code

    with spy:  # another thread's long transaction
        callers = [threading.Thread(target=call, args=(p,)) for p in paths]
        for c in callers:
            c.start()
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200  # the loop serves on
            time.sleep(0.05)
        assert set(answers) <= {"/metrics"}, answers  # (its figures need no lock) the rest wait, off the loop
    for c in callers:
        c.join(60)
    assert spy.loop_waits == 0
    assert answers == {**{p: 200 for p in paths}, "/readyz": 503}, answers  # 503: its loops are not running


def test_a_large_json_body_is_parsed_off_the_event_loop(served, monkeypatch):
    """Parsing a JSON job holds the interpreter in proportion to its size (up to
    HSSTREAM_MAX_JSON_BYTES, most of a second here): above PARSE_INLINE_BYTES it runs on a worker
    thread, so the loop serves the probes and other requests meanwhile (FastAPI parsed every body
    on the loop)."""
    import json

    url, _svc, spy = served
    where: list[tuple[int, int]] = []
    real = json.loads

    def loads(s, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        where.append((threading.get_ident(), len(s)))
        return real(s, *a, **kw)

    monkeypatch.setattr(json, "loads", loads)
    body = {"samples": [{"token_ids": list(range(i, i + 200))} for i in range(2000)]}  # ~3 MB
    r = httpx.post(f"{url}/v1/jobs", json=body, headers={"authorization": "Bearer t"}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    big = [t for t, n in where if n > 1 << 20]
    assert big and spy.loop_thread not in big, (big, spy.loop_thread)
