"""Client mistakes that once became 500s (found by tests/integration/server/test_sidecar_hardening.py's
fuzzing): text JSON can carry but UTF-8 cannot (lone surrogates), and paths that
percent-decode to bytes that are not UTF-8. They are 4xx with a readable message."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from connector.contract.api_token import read_token
from connector.contract.rest_client import auth_headers
from connector.contract.settings import Settings
from server.app import create_app


@pytest.fixture
def client(tmp_path):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9")
    app = create_app(s)  # no token set: the sidecar made one in its run dir, which its clients read
    return TestClient(app, raise_server_exceptions=False, headers=auth_headers(read_token(s.run_dir)))  # no lifespan: nothing starts


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


def test_readyz_says_when_notices_stopped_and_clears_with_the_next_notice(client):
    """A dead notice thread in the connector is seen here: a sample's notice timed out and none
    came after. The next notice (from anyone's connector) clears it."""
    import time

    from connector import protocol as P

    svc = client.app.state.services
    for e in svc.submitter.engines:  # vLLM "answered" (no lifespan here, so no HTTP client)
        e.model_name = "verifier"

    def problems() -> list[str]:
        r = client.get("/readyz")
        assert r.status_code == 503, r.text  # the loops are not started here: never ready
        return r.json()["problems"]

    assert not [p for p in problems() if p.startswith("notices stopped")]
    svc.submitter.last_notice_timeout_at = time.monotonic()
    (p,) = [p for p in problems() if p.startswith("notices stopped")]
    assert "HSSTREAM_NOTICE_TIMEOUT_S" in p and svc.settings.notice_ep() in p
    svc.notices.handle(P.Notice(request_id="r", status=P.NoticeStatus.error, reason="x", layer_ids=[1],
                                num_hidden_layers=2, hidden_size=4, dtype="bfloat16", model="m").encode())  # fmt: skip
    assert not [p for p in problems() if p.startswith("notices stopped")]
