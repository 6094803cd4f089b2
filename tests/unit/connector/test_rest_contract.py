"""The REST contract (``connector/contract/rest.py``): the one client and the real sidecar app agree.

Every route of the app is called through :class:`SidecarClient` (the sidecar's lifespan runs:
its loops, the ledger, the delivery socket; vLLM is unreachable, so samples stay queued). Each
answer the client parsed is compared with the JSON the server sent: a key the models do not
describe, or one they describe differently, fails here. A server whose answers drift from the
models (a field renamed, a type changed) makes the client raise :class:`SidecarError`, which
names the contract, instead of a ``KeyError`` in a caller.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel

from connector.contract.rest import JobOptions
from connector.contract.rest_client import SidecarClient, SidecarError, UploadCounter, auth_headers
from connector.contract.settings import Settings
from server.app import create_app

TOKEN = "contract-token"


@pytest.fixture
def app_client(tmp_path, tiny_model):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 model=tiny_model, api_token=TOKEN)  # fmt: skip
    with TestClient(create_app(s), raise_server_exceptions=False) as tc:
        sent: list[httpx.Response] = []

        def keep(r: httpx.Response) -> None:
            r.read()
            sent.append(r)

        tc.event_hooks = {"request": [], "response": [keep]}
        tc.sent = sent  # type: ignore[attr-defined]
        yield tc


def as_sent(value: object) -> object:
    """What the client parsed, written back as JSON (the keys the server set, no more)."""
    if isinstance(value, list):
        return [as_sent(v) for v in value]
    assert isinstance(value, BaseModel)
    return value.model_dump(mode="json", exclude_unset=True)


def agrees(tc: TestClient, value: object) -> object:
    """``value`` (the client's parse of the last answer) is that answer, key for key."""
    raw = tc.sent[-1].json()  # type: ignore[attr-defined]
    assert as_sent(value) == raw, (as_sent(value), raw)
    return value


def test_every_client_call_parses_what_the_server_sends(app_client, tmp_path):
    tc = app_client
    c = SidecarClient(http=tc, token=TOKEN)
    assert agrees(tc, c.healthz()).ok is True
    ready = agrees(tc, c.readyz())  # vLLM at :9 is unreachable: 503 is an answer, with the problems
    assert ready.ready is False and any("not reachable" in p for p in ready.problems)
    anonymous = SidecarClient(http=tc, token="").readyz()
    assert agrees(tc, anonymous).ready is False and anonymous.problems is None  # not to strangers

    created = agrees(tc, c.create_job([{"prompt": "hello"}, {"token_ids": [1, 2, 3]}, {"prompt": "x", "foo": 1}],
                                      JobOptions(loss_mask="all")))  # fmt: skip
    assert created.num_samples == 3 and "'foo'" in created.warnings[0]
    skipped = agrees(tc, c.create_job([{"prompt": "a"}, {"token_ids": [10**9]}], {"on_invalid": "skip"}))
    assert skipped.num_failed_at_submission == 1
    counter = UploadCounter()
    uploaded = agrees(tc, c.upload(iter([{"prompt": "a"}, {"prompt": "b"}]), {"epochs": 2}, counter=counter))
    assert uploaded.num_samples == 4 and counter.rows == 2

    listed = agrees(tc, c.jobs())
    assert [j.job_id for j in listed] == [created.job_id, skipped.job_id, uploaded.job_id]
    st = agrees(tc, c.job(created.job_id))
    assert st.num_samples == 3 and st.counts["queued"] == 3 and not st.done and st.errors == []
    tcounts = agrees(tc, c.token_counts(created.job_id))
    assert tcounts.total_tokens > 3 and tcounts.counts[1] == 1  # token ids parsed back to ints
    page = agrees(tc, c.job_samples(created.job_id, offset=1, limit=1))
    assert page.num_samples == 3 and [(x.index, x.token_ids) for x in page.samples] == [(1, [1, 2, 3])]
    assert [x.index for x in c.iter_job_samples(created.job_id, page_size=2)] == [0, 1, 2]

    # pagination: five samples with errors, read two at a time
    big = c.create_job([{"token_ids": [5 + i]} for i in range(7)])
    ledger = tc.app.state.services.ledger
    failed = [s.key.index for s in ledger.job_samples(big.job_id)[:5]]
    for s in ledger.job_samples(big.job_id)[:5]:
        ledger.fail(s.key, f"failed {s.key.index}")
    page = agrees(tc, c.job(big.job_id, errors_offset=2, errors_limit=2))
    assert [e.index for e in page.errors] == failed[2:4] and page.errors_total == 5 and page.errors_offset == 2
    errors = list(c.job_errors(big.job_id, page_size=2))
    assert [e.index for e in errors] == failed and errors[4].errors == [f"failed {failed[4]}"]

    stats = agrees(tc, c.stats())
    assert stats.states["queued"] >= 3 and stats.engines[0].url == "http://127.0.0.1:9" and stats.sample_size.known

    from trainer_client import HiddenStateStream  # a trainer connected: the overview lists it

    s = tc.app.state.services.settings
    with HiddenStateStream(s.delivery_ep(), jobs=[created.job_id], spool_dir=s.spool_dir, timeout_s=30, idle_s=0.2,
                           heartbeat_s=0.2) as stream:  # fmt: skip
        it = iter(stream)
        for _ in range(100):
            assert next(it) is None  # idle: vLLM is down, no sample comes
            ov = agrees(tc, c.overview())
            if ov.trainers:
                break
    assert ov.trainers[0].jobs == [created.job_id] and ov.jobs_total == 4 and ov.jobs[0].job_id == big.job_id

    cancelled = agrees(tc, c.cancel(created.job_id))
    assert cancelled.cancelled and cancelled.counts["cancelled"] == 3 and not cancelled.purged
    purged = agrees(tc, c.cancel(skipped.job_id, purge=True))  # what `hsstream proxy forget` asks for
    assert purged.purged and purged.counts["cancelled"] == 1 and c.job(skipped.job_id).compacted
    with pytest.raises(SidecarError) as e:
        c.job_samples(skipped.job_id)
    assert e.value.status == 410  # its token ids are gone now, not after the retention
    assert agrees(tc, c.cancel(skipped.job_id, purge=True)).purged  # purging twice: done already
    assert "hsstream_" in c.metrics()
    assert "/v1/jobs/{job_id}" in c.openapi()["paths"]


def test_refusals_are_one_error_with_the_status_and_the_servers_detail(app_client):
    tc = app_client
    c = SidecarClient(http=tc, token=TOKEN)
    with pytest.raises(SidecarError) as e:
        c.job("nope")
    assert e.value.status == 404 and e.value.detail == "unknown job 'nope'" and str(e.value) == "404: unknown job 'nope'"
    with pytest.raises(SidecarError) as e:
        SidecarClient(http=tc, token="wrong").jobs()
    assert e.value.status == 401 and "bearer token" in e.value.detail
    with pytest.raises(SidecarError) as e:
        c.create_job([{"token_ids": [10**9]}])
    assert e.value.status == 422 and "nothing was queued" in e.value.detail["message"]
    with pytest.raises(SidecarError) as e:
        c.upload([{"prompt": "a"}], '{"epochs": 0}')
    assert e.value.status == 422 and e.value.detail["message"] == "bad options"
    with pytest.raises(SidecarError) as e:
        c.job(c.create_job([{"prompt": "a"}]).job_id, errors_limit=5000)
    assert e.value.status == 422 and not e.value.unreachable
    with pytest.raises(SidecarError) as e, SidecarClient("http://127.0.0.1:9", timeout=5) as nobody:
        nobody.healthz()
    assert e.value.unreachable and str(e.value).startswith("sidecar not reachable at http://127.0.0.1:9")


def test_a_source_that_breaks_mid_upload_is_raised_as_it_is_and_nothing_stays_queued(app_client):
    tc = app_client
    c = SidecarClient(http=tc, token=TOKEN)

    def rows():
        yield {"prompt": "a"}
        raise ValueError("row 2 is not JSON")

    with pytest.raises(ValueError, match="row 2 is not JSON"):
        c.upload(rows())
    assert all(j.done for j in c.jobs())  # a job the cut body made, if any, was taken back


def test_the_token_comes_from_the_argument_or_the_environment(app_client, monkeypatch):
    tc = app_client
    monkeypatch.setenv("HSSTREAM_API_TOKEN", TOKEN)
    assert SidecarClient(http=tc).jobs() == []  # from the environment
    with pytest.raises(SidecarError, match="401"):
        SidecarClient(http=tc, token="").jobs()  # "" sends none
    assert auth_headers(TOKEN) == {"authorization": f"Bearer {TOKEN}"} and auth_headers("") == {}


def test_every_route_is_called_by_the_client(app_client, tmp_path):
    """A route added without a client method fails here (the hidden docs page excepted)."""
    tc = app_client
    test_every_client_call_parses_what_the_server_sends(tc, tmp_path)
    called = {(r.request.method, r.request.url.path) for r in tc.sent}  # type: ignore[attr-defined]
    routes = [r for r in tc.app.routes if isinstance(r, APIRoute) and r.path != "/docs"]
    missing = [(m, r.path) for r in routes for m in r.methods
               if not any(cm == m and re.fullmatch(r.path_regex, p) for cm, p in called)]  # fmt: skip
    assert not missing and len(routes) >= 12, missing


def drifted(tc: TestClient, rename: dict[str, str]) -> SidecarClient:
    """A client whose server renames keys in its answers (a sidecar of another version)."""

    def handler(request: httpx.Request) -> httpx.Response:
        r = tc.request(request.method, request.url.path, params=request.url.params, content=request.content,
                       headers=dict(request.headers))  # fmt: skip
        text = r.text
        for old, new in rename.items():
            text = text.replace(json.dumps(old) + ":", json.dumps(new) + ":")
        return httpx.Response(r.status_code, content=text.encode(), headers={"content-type": "application/json"})

    return SidecarClient(http=httpx.Client(transport=httpx.MockTransport(handler), base_url="http://sidecar"),
                         token=TOKEN)  # fmt: skip


@pytest.mark.parametrize(("call", "key"), [
    ("jobs", "compacted"), ("job", "num_samples"), ("job", "counts"), ("token_counts", "total_tokens"),
    ("stats", "reserved_bytes"), ("overview", "jobs_done"), ("overview", "file_bytes"), ("healthz", "ok"),
    ("readyz", "ready"), ("create_job", "job_id"), ("cancel", "removed_files"),
])  # fmt: skip
def test_an_answer_that_drifted_from_the_contract_is_refused_naming_it(app_client, call, key):
    tc = app_client
    job = SidecarClient(http=tc, token=TOKEN).create_job([{"prompt": "hello"}]).job_id
    c = drifted(tc, {key: key + "_renamed"})
    args = {"job": (job,), "token_counts": (job,), "cancel": (job,), "create_job": ([{"prompt": "x"}],)}.get(call, ())
    with pytest.raises(SidecarError, match=r"does not match connector/contract/rest\.py") as e:
        getattr(c, call)(*args)
    assert key in str(e.value)
    assert getattr(drifted(tc, {}), call)(*args) is not None  # the same call, undrifted, parses


def test_the_contract_and_its_client_import_nothing_of_ours_but_the_contract():
    """The trainer imports the client: it must not pull in the sidecar, the CLI or FastAPI."""
    import subprocess
    import sys

    code = ("import sys\nfor m in ('vllm', 'fastapi', 'uvicorn', 'transformers', 'torch', 'server', 'hsstream', "
            "'trainer_client'):\n    sys.modules[m] = None\nimport connector.contract.rest_client\n"
            "print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in "
            "('connector', 'server', 'hsstream', 'trainer_client')))")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.replace("'", '"')) == ["connector", "connector.contract", "connector.contract.rest",
                                                      "connector.contract.rest_client"]  # fmt: skip


@pytest.fixture
def live_sidecar(tmp_path, tiny_model):
    """The real app under real uvicorn on a free loopback port (in a thread), for a plain httpx client."""
    import threading
    import time

    import uvicorn

    from hsstream.devstack import free_port

    s = Settings(run_dir=tmp_path / "run-live", spool_dir=tmp_path / "spool-live", vllm_url="http://127.0.0.1:9",
                 model=tiny_model, api_token=TOKEN)  # fmt: skip
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(s), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and t.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(10)


@pytest.mark.parametrize("library", ["httpx", "testclient"])
def test_the_client_works_over_whichever_http_library_sends(library, app_client, live_sidecar):
    """``SidecarClient`` hands its client only what httpx and httpx2 both take (issue 38): over
    httpx against real uvicorn, and over Starlette's ``TestClient`` — an ``httpx2.Client`` as of
    Starlette 1.10, which refused the ``httpx.Timeout`` an upload used to pass."""
    if library == "httpx":
        c = SidecarClient(live_sidecar, token=TOKEN)
        assert isinstance(c._http, httpx.Client)
    else:
        c = SidecarClient(http=app_client, token=TOKEN)
        import starlette

        if tuple(int(x) for x in starlette.__version__.split(".")[:2]) >= (1, 10):
            import httpx2

            assert isinstance(app_client, httpx2.Client)  # the case the fix is for, really exercised
    created = c.upload(iter([{"prompt": "a"}, {"prompt": "b"}]), {"epochs": 2})  # the per-call read timeout
    assert created.num_samples == 4 and c.job(created.job_id).num_samples == 4
    with pytest.raises(SidecarError) as e:
        c.job("nope")
    assert e.value.status == 404


def test_a_failure_to_reach_the_sidecar_is_one_error_whichever_library_sent():
    """The client's own library's ``HTTPError`` is caught (httpx2's is not httpx's)."""
    from connector.contract.rest_client import transport_errors

    httpx2 = pytest.importorskip("httpx2")
    with httpx2.Client(base_url="http://127.0.0.1:9", timeout=5) as h:
        assert httpx2.HTTPError in transport_errors(h)
        with pytest.raises(SidecarError) as e:
            SidecarClient(http=h, token="").healthz()
    assert e.value.unreachable
