"""What one request may ask of the sidecar: a job's samples and rows (samples x epochs) are
bounded by settings, and a refusal names the limit and the setting to change."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from connector.contract.api_token import read_token
from connector.contract.rest_client import auth_headers
from connector.contract.settings import Settings
from server.app import create_app


@pytest.fixture
def client(tmp_path):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 max_job_samples=5, max_job_rows=20)  # fmt: skip
    app = create_app(s)  # no token set: the sidecar made one in its run dir, which its clients read
    return TestClient(app, raise_server_exceptions=False, headers=auth_headers(read_token(s.run_dir)))  # no lifespan: nothing starts


def _job(n: int, epochs: int = 1) -> dict:
    return {"samples": [{"token_ids": [1, 2, 3]}] * n, "options": {"epochs": epochs}}


def test_a_job_within_the_limits_is_admitted(client):
    r = client.post("/v1/jobs", json=_job(5, epochs=4))
    assert r.status_code == 200, r.text
    assert r.json()["num_samples"] == 20


def test_too_many_samples_is_a_413_naming_the_setting(client):
    r = client.post("/v1/jobs", json=_job(6))
    assert r.status_code == 413, r.text
    assert "the job has 6 samples; the limit is 5 per job (HSSTREAM_MAX_JOB_SAMPLES)" in r.json()["detail"]


def test_too_many_rows_is_a_413_naming_the_setting(client):
    r = client.post("/v1/jobs", json=_job(5, epochs=5))
    assert r.status_code == 413, r.text
    assert "5 samples x 5 epochs = 25 rows; the limit is 20 per job (HSSTREAM_MAX_JOB_ROWS)" in r.json()["detail"]


def test_an_upload_stops_reading_at_the_sample_limit(client):
    lines = "".join(json.dumps({"token_ids": [1, 2]}) + "\n" for _ in range(50))
    r = client.post("/v1/jobs/upload", files={"file": ("a.jsonl", lines.encode())})
    assert r.status_code == 413, r.text
    assert "more than 5 samples" in r.json()["detail"] and "HSSTREAM_MAX_JOB_SAMPLES" in r.json()["detail"]
    r = client.post("/v1/jobs/upload", files={"file": ("a.jsonl", lines.encode()[: len(lines) // 10])},
                    data={"options": json.dumps({"epochs": 5})})  # fmt: skip
    assert r.status_code == 413 and "HSSTREAM_MAX_JOB_ROWS" in r.json()["detail"], r.text


@pytest.mark.parametrize("case", ["too many samples", "too many rows", "a bad line last", "no record"])
def test_a_refused_upload_leaves_no_job_and_no_staged_row(client, case, monkeypatch):
    """Records are staged as they are read (2 at a time here, so some are before the refusal);
    a job refused on the way is dropped whole: no job, no row (the answers are the ones a whole
    read gave)."""
    from server.routers import jobs

    monkeypatch.setattr(jobs, "ADD_BATCH", 2)
    line = json.dumps({"token_ids": [1, 2]}) + "\n"
    body, opts, want = {
        "too many samples": (line * 50, {}, (413, "more than 5 samples")),
        "too many rows": (line * 5, {"epochs": 5}, (413, "5 samples x 5 epochs = 25 rows")),
        "a bad line last": (line * 4 + "{oops\n", {}, (422, "1 bad line(s)")),
        "no record": ("\n\n", {}, (422, "holds no records")),
    }[case]
    r = client.post("/v1/jobs/upload", files={"file": ("a.jsonl", body.encode())}, data={"options": json.dumps(opts)})
    assert r.status_code == want[0] and want[1] in r.text, r.text
    led = client.app.state.services.ledger
    assert led.job_ids() == [] and not led.jobs
    assert led._db.execute("SELECT count(*) FROM staged_samples").fetchone()[0] == 0
    r = client.post("/v1/jobs/upload", files={"file": ("a.jsonl", (line * 5).encode())})  # and the next one is fine
    assert r.status_code == 200 and r.json()["num_samples"] == 5, r.text
