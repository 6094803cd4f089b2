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
    assert page.next_offset is None
    first = c.job_samples(job, limit=3)
    assert [x.index for x in first.samples] == [0, 1, 2] and first.next_offset == 3
    assert c.job_samples(job, offset=8).samples == []


def test_num_samples_is_one_epochs_and_only_epoch_0_is_served(client):
    tc, c = client
    job = c.create_job([{"token_ids": [1, 2, 3]} for _ in range(5)], {"epochs": 3}).job_id
    page = c.job_samples(job, limit=1000)
    assert page.num_samples == 5 and [x.index for x in page.samples] == list(range(5)) and page.next_offset is None


def test_a_page_is_bounded_in_tokens_and_goes_on_where_it_stopped(client, monkeypatch):
    import server.routers.jobs as J

    tc, c = client
    monkeypatch.setattr(J, "SAMPLES_PAGE_TOKENS", 10)
    job = c.create_job([{"token_ids": [7] * 4} for _ in range(6)] + [{"token_ids": [8] * 30}]).job_id
    page = c.job_samples(job, limit=1000)
    assert [x.index for x in page.samples] == [0, 1] and page.next_offset == 2  # 8 tokens; a third would be 12
    assert [x.index for x in c.iter_job_samples(job)] == list(range(7))  # the 30-token one alone in its page
    last = c.job_samples(job, offset=6)
    assert [len(x.token_ids) for x in last.samples] == [30] and last.next_offset is None


def test_the_held_out_share_is_picked_by_the_sidecar_with_the_shared_rule(client):
    from connector.contract.holdout import held_out, sample_identity

    tc, c = client
    rows = [{"token_ids": [3, 4], **({"id": f"r{i}"} if i % 2 else {})} for i in range(60)]
    job = c.create_job(rows).job_id
    want = [i for i in range(60) if held_out(sample_identity(rows[i].get("id"), i), 0.2, 11)]
    assert 0 < len(want) < 60
    got = [x.index for x in c.iter_job_samples(job, page_size=7, eval_fraction=0.2, eval_seed=11)]
    assert got == want
    assert [x.index for x in c.iter_job_samples(job, eval_fraction=0.2, eval_seed=12)] != want  # another seed


def test_a_regenerate_jobs_samples_say_where_the_prompt_ends(client):
    tc, c = client
    job = c.create_job([{"token_ids": [5, 6, 7]}], {"mode": "regenerate", "sampling": {"max_tokens": 4}}).job_id
    (s,) = c.job_samples(job).samples
    assert s.token_ids == [5, 6, 7] and s.prompt_len == 3
    plain = c.job_samples(c.create_job([{"token_ids": [5, 6, 7]}]).job_id).samples[0]
    assert plain.prompt_len is None


def test_limits_unknown_jobs_and_strangers_are_refused_without_a_5xx(client):
    tc, c = client
    job = c.create_job([{"token_ids": [1, 2]}]).job_id
    h = {"authorization": f"Bearer {TOKEN}"}
    for q in ("limit=1001", "limit=0", "offset=-1", "offset=x", "eval_fraction=1", "eval_fraction=-0.1",
              "eval_fraction=nan", "eval_seed=1e30", f"eval_seed={2**63}"):
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
    assert r.status_code == 410 and "compacted" in r.text, r.text
