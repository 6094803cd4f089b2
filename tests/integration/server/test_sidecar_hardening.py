"""The sidecar under hostile or careless clients, on a real uvicorn process with its default
limits (no vLLM behind it: every check here needs none): bodies without a Content-Length,
and a few thousand generated requests across every route."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from bench.long_checks.fuzz_sidecar import NON_FINITE, TOKEN, chunked  # the token chunked() sends
from bench.long_checks.fuzz_sidecar import poison as poison_body
from tests.integration.conftest import sidecar_without_vllm


@pytest.fixture(scope="module")
def sidecar(tiny_model):
    with sidecar_without_vllm(tiny_model, TOKEN, "hsstream-hard-", HSSTREAM_VLLM_DOWN_DEADLINE_S="2") as sc:
        yield sc.url, sc.port, psutil.Process(sc.child.proc.pid), sc.log


def _rss(proc: psutil.Process) -> int:
    """The sidecar's resident memory, its children (none expected) included."""
    return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))


_PART = (b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
         b"Content-Type: application/octet-stream\r\n\r\n")


@pytest.mark.parametrize(
    ("path", "ctype", "first"),
    [("/v1/jobs", "application/json", b'{"samples": '),
     ("/v1/jobs/upload", "multipart/form-data; boundary=xyz", _PART)],  # a well-formed upload, only too long
)  # fmt: skip
def test_chunked_300_mib_body_is_refused_without_being_read_whole(sidecar, path, ctype, first):
    url, port, proc, _ = sidecar
    before = _rss(proc)
    reply = chunked(port, path, ctype, first, 300 * 2**20)  # the fuzz's own raw chunked POST
    grew = _rss(proc) - before
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"exceeds the limit" in reply
    assert grew < 50 * 2**20, f"sidecar RSS grew by {grew / 2**20:.0f} MiB for a refused body"
    assert httpx.get(f"{url}/healthz").status_code == 200


#: Numbers Python's JSON reads (``1e400`` as infinity) and no JSON encoder writes back.
def test_generated_requests_across_every_route(sidecar):
    """schemathesis draws requests from the sidecar's own OpenAPI schema (valid and invalid
    bodies, paths and query values) for every route, aimed in part at real jobs' ids, with
    non-finite numbers put into bodies and integers past 64 bits into queries: no 500 (an
    unhandled error; /readyz's documented 503 is fine), the server stays up, and its memory
    does not creep."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    url, _, proc, log = sidecar
    auth = {"authorization": f"Bearer {TOKEN}"}
    jobs = []
    for n in (1, 3, 40):  # real jobs to aim at (the sidecar has no vLLM: their samples fail in time)
        r = httpx.post(f"{url}/v1/jobs", json={"samples": [{"token_ids": [1, 2, 3]}] * n}, headers=auth)
        assert r.status_code == 200, r.text
        jobs.append(r.json()["job_id"])
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json", headers=auth).json())
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 8, [o.label for o in ops]
    n_requests, seen, failures, rss_at_200 = 2000, set(), [], []
    session = __import__("requests").Session()
    count, aimed, poisoned = 0, 0, 0

    @settings(max_examples=n_requests, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.one_of(*(op.as_strategy() for op in ops)), st.sampled_from([None, *jobs]),
           st.none() | st.tuples(st.integers(0, 50), st.sampled_from(NON_FINITE)))  # fmt: skip
    def one(case, job, poison):  # noqa: ANN001
        nonlocal count, aimed, poisoned
        params = case.path_parameters or {}
        if job is not None and "job_id" in params:
            params["job_id"] = job
            aimed += 1
        if poison is not None and case.operation.method.upper() == "POST" and case.operation.path == "/v1/jobs":
            poisoned += 1
            text = poison_body(case.body, *poison)
            r = session.post(f"{url}/v1/jobs", data=text.encode(), timeout=30,
                             headers={**auth, "content-type": "application/json"})  # fmt: skip
            what = f"POST /v1/jobs {text[:1000]}"
        elif poison is not None and case.operation.label == "GET /v1/jobs/{job_id}":
            poisoned += 1
            big = str(2**63 + poison[0]) if poison[0] % 2 else str(-(10**30))
            r = session.get(f"{url}/v1/jobs/{params['job_id']}", params={"errors_offset": big,
                            "errors_limit": big}, headers=auth, timeout=30)  # fmt: skip
            what = f"GET {r.url}"
        else:
            r = case.call(base_url=url, session=session, headers=auth, timeout=30)
            what = repr(case)[:1500]
        count += 1
        seen.add(case.operation.label)
        ok = r.status_code < 500 or (case.operation.path == "/readyz" and r.status_code == 503)
        if not ok:
            failures.append((case.operation.label, r.status_code, r.text[:300], what))
        if count == 200:
            rss_at_200.append(_rss(proc))

    t0 = time.monotonic()
    one()
    took = time.monotonic() - t0
    assert count >= n_requests, count
    assert not failures, (failures[:5], log.read_text()[-3000:])
    assert seen == {o.label for o in ops}, f"never called: {({o.label for o in ops}) - seen}"
    assert aimed > 100 and poisoned > 100, (aimed, poisoned)
    assert httpx.get(f"{url}/healthz").status_code == 200 and proc.is_running()
    grew = _rss(proc) - rss_at_200[0]
    print(f"{count} requests over {len(seen)} routes in {took:.0f} s ({aimed} at real jobs, {poisoned} with "
          f"non-finite or oversized numbers); RSS {rss_at_200[0] / 2**20:.0f} MiB after 200, "
          f"{grew / 2**20:+.1f} MiB after {count}")
    assert grew < 20 * 2**20, f"RSS grew {grew / 2**20:.1f} MiB after the first 200 requests"
    assert "Traceback" not in log.read_text(), "the sidecar logged an unhandled error"


def test_a_big_job_never_stalls_the_api(sidecar):
    """Admitting a big job (tokenising, the ledger's rows: 200,000 here) happens off the event
    loop and in bounded batches: /healthz, polled all along, answers each time within 1 s."""
    import threading

    url, _, _, _ = sidecar
    auth = {"authorization": f"Bearer {TOKEN}"}
    samples = [{"prompt": f"sample {i}: the quick brown fox"} for i in range(1000)]
    samples += [{"token_ids": [1 + i % 500] * 8} for i in range(1000)]
    body = {"samples": samples, "options": {"epochs": 100}}
    out: dict = {}

    def submit() -> None:
        out["r"] = httpx.post(f"{url}/v1/jobs", json=body, headers=auth, timeout=300)

    t = threading.Thread(target=submit)
    waits = []
    with httpx.Client(timeout=30) as c:
        c.get(f"{url}/healthz")
        t.start()
        while t.is_alive():
            t0 = time.monotonic()
            assert c.get(f"{url}/healthz").status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
    t.join()
    assert out["r"].status_code == 200, out["r"].text[:500]
    assert out["r"].json()["num_samples"] == 2000 * 100
    print(f"job admitted in {len(waits)} polls; slowest /healthz {max(waits):.3f} s")
    assert len(waits) > 5 and max(waits) < 1.0, f"/healthz took {max(waits):.1f} s while a job was admitted"
    job = out["r"].json()["job_id"]
    assert httpx.delete(f"{url}/v1/jobs/{job}", headers=auth, timeout=120).status_code == 200
