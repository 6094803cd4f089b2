"""Client mistakes that once became 500s (found by tests/integration/test_sidecar_hardening.py's
fuzzing): text JSON can carry but UTF-8 cannot (lone surrogates), and paths that
percent-decode to bytes that are not UTF-8. They are 4xx with a readable message."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from connector.settings import Settings
from server.app import create_app


@pytest.fixture
def client(tmp_path):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9")
    return TestClient(create_app(s), raise_server_exceptions=False)  # no lifespan: nothing starts


@pytest.mark.parametrize(
    ("body", "where"),
    [(b'{"samples": [{"prompt": "a\\ud800"}]}', "sample.prompt"),
     (b'{"samples": [{"token_ids": [1], "id": "\\udfff"}]}', "sample.id"),
     (b'{"samples": [{"messages": [{"role": "user", "content": "x", "name": ["\\ud800"]}]}]}', "messages[0].name"),
     (b'{"samples": [{"prompt": "a"}], "options": {"mode": "\\ud800"}}', "")],
)  # fmt: skip
def test_lone_surrogates_are_a_422_naming_the_field(client, body, where):
    r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert where in r.text


def test_upload_with_lone_surrogates_is_a_422(client):
    r = client.post("/v1/jobs/upload", files={"file": ("a.jsonl", b'{"prompt": "\\ud800"}\n')})
    assert r.status_code == 422 and "bad line" in r.text
    r = client.post("/v1/jobs/upload", files={"file": ("a.jsonl", b'{"prompt": "a"}\n')},
                    data={"options": '{"mode": "\\ud800"}'})  # echoed back in the 422
    assert r.status_code == 422 and "bad options" in r.text


def test_job_id_that_is_not_utf8_is_a_404(client):
    r = client.get("/v1/jobs/%ED%A0%80")
    assert r.status_code == 404 and "unknown job" in r.json()["detail"]
