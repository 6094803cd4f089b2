"""``GET /v1/jobs/{id}/samples``: a job's samples, paged and bounded, for an evaluator to prompt with.

Through the real app (lifespan, ledger; vLLM unreachable, so samples stay queued)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from connector.contract.rest_client import SidecarClient, SidecarError
from connector.contract.settings import Settings
from server.app import create_app

TOKEN = "samples-token"


@pytest.fixture
def client(tmp_path, tiny_model):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 model=tiny_model, api_token=TOKEN)  # fmt: skip
    with TestClient(create_app(s), raise_server_exceptions=False) as tc:
        yield tc, SidecarClient(http=tc, token=TOKEN)


def test_pages_in_index_order_with_ids_masks_and_every_sample_once(client):
    tc, c = client
    rows = [{"token_ids": [10 + i, 11 + i, 12 + i], "id": f"r{i}"} for i in range(7)]
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    job = c.create_job(rows).job_id
    got = list(c.iter_job_samples(job, page_size=3))
    assert [x.index for x in got] == list(range(8))
    assert [x.id for x in got] == [f"r{i}" for i in range(7)] + [None]
    assert got[2].token_ids == [12, 13, 14] and got[2].loss_mask == [1, 1, 1] and got[2].prompt_len is None
    chat = got[7]
    assert chat.loss_mask is not None and 0 < sum(chat.loss_mask) < len(chat.token_ids)  # the assistant turn only
    page = c.job_samples(job, offset=6, limit=1000)
    assert [x.index for x in page.samples] == [6, 7] and page.num_samples == 8 and page.offset == 6
    assert c.job_samples(job, offset=8).samples == []


def test_limits_unknown_jobs_and_strangers_are_refused_without_a_5xx(client):
    tc, c = client
    job = c.create_job([{"token_ids": [1, 2]}]).job_id
    h = {"authorization": f"Bearer {TOKEN}"}
    for q in ("limit=1001", "limit=0", "offset=-1", "offset=x"):
        r = tc.get(f"/v1/jobs/{job}/samples?{q}", headers=h)
        assert r.status_code == 422, (q, r.status_code)
    assert tc.get("/v1/jobs/nope/samples", headers=h).status_code == 404
    assert tc.get(f"/v1/jobs/{job}/samples").status_code == 401
    with pytest.raises(SidecarError, match="404"):
        c.job_samples("nope")


def test_a_compacted_job_says_its_data_is_gone(client):
    tc, c = client
    job = c.create_job([{"token_ids": [1, 2]}]).job_id
    led = tc.app.state.services.ledger
    led.cancel_job(job)
    led.compact(retention_s=0, now=10**12)
    r = tc.get(f"/v1/jobs/{job}/samples", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code in (404, 410), r.text
