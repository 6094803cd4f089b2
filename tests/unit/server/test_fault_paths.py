"""Fault paths of the sidecar's logic (issue 10, item 4), each with a fake only where the real
part is the thing simulated failing (a slow vLLM, a failing database write)."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from server.ledger import Ledger, NewSample, State
from server.submitter import Submitter
from server.vllm_http import Reply
from tests.unit.server.fake_vllm_http import FakeHttp, Request, reply


def _ledger(n: int, **kw) -> tuple[Ledger, list]:
    """A ledger and its samples' keys (queued samples live in SQLite: read them with ``get``)."""
    ledger = Ledger(**kw)
    job = ledger.add_job([NewSample([1, 2, 3], None, f"s{i}", 30) for i in range(n)])
    return ledger, [s.key for s in ledger.job_samples(job.job_id)]


def test_notice_timeout_counts_from_the_response_not_from_submission():
    """A request slower than the notice timeout must not race its own notice."""
    ledger, (key,) = _ledger(1)
    sub = Submitter(ledger, "http://vllm", budget_bytes=10**9, notice_timeout_s=0.3)

    async def vllm(request: Request) -> Reply:
        if request.path == "/v1/models":
            return reply(200, {"data": [{"id": "m"}]})
        await asyncio.sleep(0.6)  # the request itself takes twice the notice timeout
        return reply(200, {"choices": [{"text": "x"}]})

    async def run() -> None:
        sub._client = FakeHttp(vllm)
        s = ledger.next_to_submit(10**9)
        sem = asyncio.Semaphore(1)
        await sem.acquire()
        await sub._submit(s, sem)  # returns once vLLM answered: the notice is on its way
        sub._sweep()  # the submit loop's sweep, right after the response
        smp = ledger.get(key)
        assert smp.state == State.submitted and smp.attempt == 0 and smp.errors == [], smp.errors
        await asyncio.sleep(0.4)  # a notice really overdue (past the timeout after the response)
        sub._sweep()
        smp = ledger.get(key)
        assert smp.state == State.queued and smp.attempt == 1 and "no notice" in smp.errors[0]
        await sub._client.aclose()

    asyncio.run(run())


class _FailingDb:
    """A sqlite connection whose n-th UPDATE of a job row fails (disk full, I/O error)."""

    def __init__(self, db: sqlite3.Connection, fail_at: int) -> None:
        self.db, self.n, self.fail_at = db, 0, fail_at

    def execute(self, sql: str, *a):  # noqa: ANN002, ANN201
        if sql.startswith("UPDATE jobs"):
            self.n += 1
            if self.n == self.fail_at:
                raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *a)


def test_an_ack_list_is_applied_whole_or_not_at_all(tmp_path):
    path = tmp_path / "ledger.sqlite"
    ledger, keys = _ledger(3, path=path)
    owner = b"Ltrainer"
    tokens = []
    for _ in keys:
        s = ledger.next_to_submit(10**9)
        ledger.on_notice(_ok(s), 30)
        tokens.append(ledger.lease_next(owner, None).lease_token)
    reserved = ledger.reserved_bytes
    real_db = ledger._db
    ledger._db = _FailingDb(real_db, fail_at=2)  # the second key's write fails
    with pytest.raises(sqlite3.OperationalError):
        ledger.ack_many(owner, keys, tokens)
    ledger._db = real_db
    assert [ledger.get(k).state for k in keys] == [State.leased] * 3  # none applied, in memory...
    assert ledger.reserved_bytes == reserved and ledger.jobs[keys[0].job].n_terminal == 0
    assert ledger.jobs[keys[0].job].tokens_consumed == 0
    states = {r[0] for r in real_db.execute("SELECT state FROM samples")}
    assert states == {"leased"}  # ...and on disk
    assert ledger.ack_many(owner, keys, tokens) == (3, 0)  # and it applies whole later
    assert [ledger.get(k).state for k in keys] == [State.consumed] * 3
    assert ledger.ack_many(owner, [keys[0]], tokens[:1]) == (0, 1)


def test_a_failed_ack_list_returns_the_trainers_leases(tmp_path):
    """The delivery thread does not leave the rest leased while the trainer heartbeats on."""
    from connector import protocol as P
    from server.delivery import DeliveryService

    ledger, keys = _ledger(2, path=tmp_path / "l.sqlite")
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    owner = b"Ltrainer"
    tokens = []
    for _ in keys:
        s = ledger.next_to_submit(10**9)
        (spool / f"hs-{s.key.index}.safetensors").write_bytes(b"x" * 30)
        ledger.on_notice(_ok(s, f"hs-{s.key.index}.safetensors"), 30)
        tokens.append(ledger.lease_next(owner, None).lease_token)
    svc = DeliveryService(f"ipc://{tmp_path}/d.sock", spool, ledger)
    real_db = ledger._db
    ledger._db = _FailingDb(real_db, fail_at=2)
    svc._on_message(owner, P.encode_msg(P.Ack(keys=keys, tokens=tokens)))
    ledger._db = real_db
    assert svc.stats["ack_errors"] == 1 and svc.stats["acked"] == 0
    samples = [ledger.get(k) for k in keys]
    assert [s.state for s in samples] == [State.ready] * 2 and all(s.lease_owner is None for s in samples)


def _ok(s, file: str = "hs-f.safetensors"):  # noqa: ANN001, ANN202
    from connector import protocol as P

    return P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt, file=file,
                    num_tokens=3, nbytes=30)  # fmt: skip
