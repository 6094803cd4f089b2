"""Several vLLM engines behind one sidecar: the submitter's spreading and per-engine failure
logic, against fake engines (at the submitter's HTTP seam) and a real ledger. The same with real
engines, one SIGKILLed mid-job: tests/integration/server/test_engines.py."""

from __future__ import annotations

import asyncio

import pytest

from server.ledger import Ledger, NewSample, State
from server.submitter import Engine, Submitter, least_loaded, parse_engine_urls
from server.vllm_http import Reply, Unreachable
from tests.unit.server.submitter_runs import probe, run_for, run_until, started, wait_until
from tests.unit.server.fake_vllm_http import FakeHttp, Request, reply


class Engines:
    """Fake engines by host name; each can be slow, refuse connections, or die mid-request."""

    def __init__(self, *hosts: str, max_model_len: dict[str, int] | None = None) -> None:
        self.delay = dict.fromkeys(hosts, 0.0)
        self.dead: set[str] = set()
        self.max_model_len = max_model_len or {}
        self.prompts: dict[str, list[int]] = {h: [] for h in hosts}  # host -> sample labels

    async def __call__(self, request: Request) -> Reply:
        host = request.host
        if host in self.dead:
            raise Unreachable("connection refused")
        if request.path == "/health":
            return reply(200)
        if request.path == "/v1/models":
            return reply(200, {"data": [{"id": "m", "max_model_len": self.max_model_len.get(host, 4096)}]})
        await asyncio.sleep(self.delay[host])
        if host in self.dead:  # killed while the request ran
            raise Unreachable("server disconnected")
        self.prompts[host].append(request.body["prompt"][0])
        return reply(200, {"choices": [{"text": "x"}]})


def submitter(ledger, fake, hosts, **kw):
    kw.setdefault("notice_timeout_s", 600)
    kw.setdefault("budget_bytes", 10**9)
    return Submitter(ledger, ",".join(f"http://{h}" for h in hosts), client=FakeHttp(fake), **kw)


def job_of(ledger, n):
    return ledger.add_job([NewSample([i, 1, 2], None, f"s{i}", 100) for i in range(n)]).job_id


def test_engine_urls_are_parsed_and_checked():
    assert parse_engine_urls("http://a:8000/, http://b:8001") == ["http://a:8000", "http://b:8001"]
    assert parse_engine_urls("http://a:8000") == ["http://a:8000"]
    with pytest.raises(ValueError, match="no vLLM URL"):
        parse_engine_urls(" , ")
    with pytest.raises(ValueError, match="'a:8000' is not an http"):
        parse_engine_urls("http://b:1,a:8000")
    with pytest.raises(ValueError, match="names an engine twice"):
        parse_engine_urls("http://a:1,http://a:1/")


def test_least_loaded_skips_down_engines_and_takes_turns_on_ties():
    a, b, c = Engine("http://a"), Engine("http://b"), Engine("http://c")
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    assert least_loaded([a, b, c]) is b
    assert least_loaded([a, b, c], start=2) is c  # a tie: the turn decides
    b.down_since = 1.0
    assert least_loaded([a, b, c]) is c
    c.down_since = 1.0
    assert least_loaded([a, b, c]) is a
    a.down_since = 1.0
    assert least_loaded([a, b, c]) is None


def test_requests_are_spread_and_a_slow_engine_gets_fewer():
    led = Ledger()
    job = job_of(led, 60)
    fake = Engines("a", "b")
    fake.delay.update(a=0.1, b=0.01)
    sub = submitter(led, fake, ["a", "b"], concurrency=4)

    asyncio.run(run_until(sub, lambda: sum(map(len, fake.prompts.values())) == 60))
    a, b = len(fake.prompts["a"]), len(fake.prompts["b"])
    assert a + b == 60 and sorted(fake.prompts["a"] + fake.prompts["b"]) == list(range(60))  # each once
    assert 0 < a < b / 2  # least-loaded: the fast engine drains more of the queue
    assert all(s.state == State.submitted and s.attempt == 0 for s in led.job_samples(job))
    assert [e["requests"] for e in (e.describe() for e in sub.engines)] == [a, b]


def test_equal_engines_share_evenly():
    led = Ledger()
    job_of(led, 40)
    fake = Engines("a", "b")
    fake.delay.update(a=0.02, b=0.02)
    sub = submitter(led, fake, ["a", "b"], concurrency=2)

    asyncio.run(run_until(sub, lambda: sum(map(len, fake.prompts.values())) == 40))
    assert abs(len(fake.prompts["a"]) - len(fake.prompts["b"])) <= 4


def test_an_unreachable_engine_costs_no_attempt_and_comes_back():
    led = Ledger()
    job = job_of(led, 20)
    fake = Engines("a", "b")
    fake.dead.add("b")
    fake.delay.update(a=0.01)
    sub = submitter(led, fake, ["a", "b"], concurrency=4)

    async def go():
        async with started(sub):
            await wait_until(lambda: len(fake.prompts["a"]) == 20)
            assert not sub.engines[1].up and sub.engines[0].up and sub.down_since is None
            fake.dead.clear()  # b starts answering: its probe brings it back
            await wait_until(lambda: sub.engines[1].up, timeout=5)
            job2 = job_of(led, 20)
            await wait_until(lambda: sum(map(len, fake.prompts.values())) == 40)
            return job2

    job2 = asyncio.run(go())
    assert fake.prompts["b"] and sorted(fake.prompts["a"] + fake.prompts["b"]) == sorted(list(range(20)) * 2)
    for s in led.job_samples(job) + led.job_samples(job2):
        assert s.state == State.submitted and not s.errors  # nothing spent for an engine being away
    assert sub.engines[1].failures >= 1 and sub.stats["vllm_down_retries"] >= 1


def test_an_engine_killed_mid_request_and_after_answering_loses_nothing():
    """In-flight requests fail and go to the other engine; samples the dead engine had answered
    but whose file had not come are re-queued at once, not after the notice timeout."""
    led = Ledger()
    job = job_of(led, 6)
    fake = Engines("a", "b")
    fake.delay.update(a=0.3, b=0.0)
    sub = submitter(led, fake, ["a", "b"], concurrency=2)

    async def go():
        async with started(sub):
            # b answers at once; keep it busy-looking so a also gets requests
            await wait_until(lambda: len(fake.prompts["b"]) >= 1 and sub.engines[0].in_flight >= 1)
            answered_by_b = {k for k in sub.engines[1].answered}
            assert answered_by_b
            fake.dead.add("b")  # b dies: what it answered will never have a file
            fake.delay["a"] = 0.01
            await wait_until(lambda: not sub.engines[1].up)
            return answered_by_b

    lost = asyncio.run(go())
    for s in led.job_samples(job):
        if s.key in lost:
            # re-queued without an attempt spent (the attempt number moves on so a late file is refused)
            assert s.attempt >= 1 and not s.errors, s
    assert sub.engines[1].answered == {} and sub.stats["requeued_engine_lost"] == len(lost)


def test_every_engine_down_past_the_deadline_fails_with_the_reason():
    led = Ledger()
    job = job_of(led, 3)
    fake = Engines("a", "b")
    fake.dead.update({"a", "b"})
    sub = submitter(led, fake, ["a", "b"], down_deadline_s=0.5)

    asyncio.run(run_until(sub, lambda: all(s.state == State.failed for s in led.job_samples(job)), timeout=6))
    s = led.job_samples(job)[0]
    assert "vLLM at http://a, http://b unreachable for more than 0 s" in s.errors[-1]
    assert s.attempt >= 1 and len(s.errors) == 1  # waiting spent nothing; only the deadline failed it


def test_one_engine_down_does_not_start_the_deadline():
    led = Ledger()
    job = job_of(led, 5)
    fake = Engines("a", "b")
    fake.dead.add("b")
    sub = submitter(led, fake, ["a", "b"], down_deadline_s=0.2)

    asyncio.run(run_for(sub, 1.0))
    assert all(s.state == State.submitted for s in led.job_samples(job))


def test_admission_uses_the_smallest_engine_limit():
    led = Ledger()
    fake = Engines("a", "b", max_model_len={"a": 2048, "b": 512})
    limits = []
    sub = submitter(led, fake, ["a", "b"], on_engine_limit=limits.append)

    assert asyncio.run(probe(sub)) == 512 and limits[-1] == 512
    assert [e.max_model_len for e in sub.engines] == [2048, 512]


# ----------------------------------------------------------------------------- hsstream up --engines N


def test_up_starts_n_engines_on_consecutive_ports_with_their_own_cores(monkeypatch, up_spawns):
    import os
    import sys

    from hsstream import up

    for k in [k for k in os.environ if k.startswith(("HSSTREAM_", "VLLM_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(up.launch, "num_hidden_layers", lambda _m: 12)
    monkeypatch.setattr(up.launch, "is_cpu_build", lambda: True)
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _p: {0, 1, 2, 3})
    monkeypatch.setenv("VLLM_PORT", "8200")
    cfg = up.build_config(model="some/hub-model", layer_ids="2,6,9", engines=2)
    assert cfg.env["HSSTREAM_VLLM_URL"] == "http://127.0.0.1:8200,http://127.0.0.1:8201"
    assert parse_engine_urls(cfg.env["HSSTREAM_VLLM_URL"]) == [cfg.engine_url(0), cfg.engine_url(1)]
    sup = up.Supervisor(cfg, echo=False)
    for i in range(2):
        with pytest.raises(OSError, match="not starting"):
            sup._spawn_vllm(i)
    (a0, env0), (a1, env1) = up_spawns
    assert a0[:4] == [sys.executable, "-m", "hsstream", "vllm"]
    assert a0[a0.index("--port") + 1] == "8200" and a1[a1.index("--port") + 1] == "8201"
    assert (env0["VLLM_CPU_OMP_THREADS_BIND"], env1["VLLM_CPU_OMP_THREADS_BIND"]) == ("0-1", "2-3")
    assert [up.engine_name(i) for i in range(3)] == ["vllm", "vllm-2", "vllm-3"]
    with pytest.raises(up.UpError, match="2 CPU engines need at least 2 cores"):
        up.split_cores([0], 2)
    monkeypatch.setenv("HSSTREAM_VLLM_URL", "http://a:1,http://b:2")
    with pytest.raises(up.UpError, match="lists several engines"):
        up.build_config(model="some/hub-model", layer_ids="2,6,9")
