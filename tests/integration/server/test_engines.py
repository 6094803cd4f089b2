"""Two vLLM engines (CPU build, one core each) feed one sidecar; one is SIGKILLed mid-job.

The stack is what ``hsstream up --engines 2`` starts (hsstream.up.Supervisor): two engine
processes with our connector, the same spool and notice endpoint, the sidecar told both URLs.
Every sample is consumed exactly once, the dead engine's in-flight samples are produced again
on the other, and nothing is left in the spool. The sidecar reaches the second engine through
a pass-through TCP proxy (tests/support/holding_proxy.py), which gives the kill its moment.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from hsstream.devstack import Stack
from tests.conftest import SESSION_ENV, prestarted
from tests.integration.conftest import stop_stack, submit, tiny, wait_spool_empty
from tests.support.holding_proxy import HoldingProxy
from trainer_client import HiddenStateStream

LAYERS = [2, 6, 9, 12]
BUDGET = 200_000  # bytes: ~4 samples of 40 tokens at a time, so production follows consumption


def _start(layout: str) -> tuple[Stack, HoldingProxy]:
    st = Stack(tiny(), LAYERS, Path(tempfile.mkdtemp(prefix="hsstream-engines-")), engines=2, base_env=SESSION_ENV)
    proxy = HoldingProxy(st.vllm_port + 1)
    st.env.update({
        "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{st.vllm_port},{proxy.url}",
        "HSSTREAM_SPOOL_BUDGET_BYTES": str(BUDGET), "HSSTREAM_NOTICE_TIMEOUT_S": "120",
        "HSSTREAM_SPOOL_LAYOUT": layout, "HSSTREAM_ARENA_QUARANTINE_S": "5",
    })  # fmt: skip
    st.layout = layout
    try:
        st.start()
    except BaseException:
        _stop((st, proxy))
        raise
    return st, proxy


def _stop(pair: tuple[Stack, HoldingProxy]) -> None:
    stop_stack(pair[0])
    pair[1].close()


#: One two-engine stack per spool layout (tests/support/prestart.py starts them ahead).
PRESTART = {layout: (lambda layout=layout: _start(layout), _stop) for layout in ("files", "arena")}


@pytest.fixture(scope="module", params=["files", "arena"])
def proxied_stack(request):
    """The stack, its second engine reached through a :class:`HoldingProxy` (the kill test's cue);
    once per spool layout (the killed engine's slot goes into quarantine, its sample elsewhere)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("two CPU engines need two cores (each engine gets its own)")
    pair = prestarted(__name__, request.param)
    try:
        yield pair
    finally:
        _stop(pair)


@pytest.fixture(scope="module")
def stack(proxied_stack):
    return proxied_stack[0]


def samples(n, seed, length=40):
    rng = random.Random(seed)
    return [{"token_ids": [rng.randrange(0, 509) for _ in range(length)], "id": f"s{seed}-{i}"} for i in range(n)]


def stats(stack):
    return httpx.get(f"{stack.api}/v1/stats", timeout=10, headers=stack.headers).json()


def status(stack, job):
    return httpx.get(f"{stack.api}/v1/jobs/{job}", timeout=10, headers=stack.headers).json()


def consume(stack, job, on_sample=None):
    labels = []
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=180) as s:
        for smp in s:
            labels.append(smp.label)
            assert smp.hidden_states.shape == (40, len(LAYERS), 128)
            if on_sample:
                on_sample(len(labels))
    return labels


def test_both_engines_get_requests_and_their_notices_arrive(proxied_stack):
    stack, proxy = proxied_stack
    assert [c.name for c in stack.children if c.name.startswith("vllm")] == ["vllm", "vllm-2"]
    engines = stats(stack)["engines"]
    assert [e["url"] for e in engines] == [f"http://127.0.0.1:{stack.vllm_port}", proxy.url]
    assert proxy.upstream[1] == stack.vllm_port + 1  # the second engine, unarmed: passed through
    n = 16
    job = submit(stack, samples(n, 1))
    labels = consume(stack, job)
    assert sorted(labels) == sorted(f"s1-{i}" for i in range(n))  # each exactly once
    st = stats(stack)
    per = [e["requests"] for e in st["engines"]]
    assert all(r > 0 for r in per) and sum(per) == n, per  # spread, and no sample sent twice
    # Every answered request's file arrived from its own engine's writer: none timed out, none failed.
    assert st["submitter"]["notice_timeouts"] == 0 and st["submitter"]["vllm_down_retries"] == 0
    assert status(stack, job)["counts"]["consumed"] == n
    assert wait_spool_empty(stack, timeout=10) == []


def test_an_engine_killed_mid_job_loses_nothing(proxied_stack):
    stack, proxy = proxied_stack
    n = 60
    proxy.arm(after=2)  # before the job: its third completion routed to the second engine is held
    job = submit(stack, samples(n, 2))
    killed: dict = {}

    def killer() -> None:
        """Kill the second engine while one of our requests to it is in flight, after it has
        answered two of this job's (mid-job). The proxy passes two completions and holds the
        next (never sent on), so that request is in flight when the engine is SIGKILLed and can
        only be produced on the other engine; the proxy counts, nothing here polls."""
        victim = next(c for c in stack.children if c.name == "vllm-2")
        if not proxy.holding.wait(120):
            killed.update(error="the second engine was sent no third completion of the job",
                          engines=stats(stack)["engines"])  # fmt: skip
            return
        e2 = stats(stack)["engines"][1]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(30)
        killed.update(in_flight=e2["in_flight"], requests=e2["requests"])

    th = threading.Thread(target=killer)
    th.start()  # the loop consumes while the killer waits for its moment

    def on_sample(used: int) -> None:
        time.sleep(0.02)  # a paced trainer, faster than the engines: both stay busy all along

    labels = consume(stack, job, on_sample)
    th.join(60)
    assert killed.get("in_flight", 0) > 0, killed
    assert sorted(labels) == sorted(f"s2-{i}" for i in range(n)), "a sample lost or yielded twice"
    st = stats(stack)
    e1, e2 = st["engines"]
    assert e1["up"] and not e2["up"] and e2["failures"] >= 1, st["engines"]
    # what the dead engine held went back to the queue (the held request failed without an
    # answer; others may have been answered with their files still owed) ...
    sub = st["submitter"]
    assert sub["vllm_down_retries"] + sub["requeued_engine_lost"] >= 1, sub
    c = status(stack, job)["counts"]
    assert c["consumed"] == n and c["failed"] == 0, c  # ... and was produced again on the other, free of charge
    assert e1["requests"] + killed["requests"] >= n
    # a file the dead engine wrote but never announced is the reaper's (60 s grace, every 10 s)
    assert wait_spool_empty(stack, timeout=90) == [], "files of the dead engine left in the spool"
