"""/readyz is open so that orchestrators need no credentials, but its problems name URLs, paths
and error text: without the token it says only whether the sidecar is ready; with the token (or
when it is served open on purpose) it lists the problems."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from connector.contract.api_token import read_token
from connector.contract.settings import Settings
from server.app import create_app

TOKEN = "readyz-token"


def _client(tmp_path, token: str | None, **kw) -> TestClient:
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 api_token=token, **kw)  # fmt: skip
    c = TestClient(create_app(s), raise_server_exceptions=False)  # no lifespan: the loops never run, never ready
    for e in c.app.state.services.submitter.engines:  # vLLM "answered" (no lifespan, so no HTTP client)
        e.model_name = "verifier"
    return c


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Bearer {TOKEN}x", f"Basic {TOKEN}"])
def test_without_the_token_readyz_answers_only_the_status(tmp_path, auth):
    c = _client(tmp_path, TOKEN)
    r = c.get("/readyz", headers={"authorization": auth} if auth else {})
    assert r.status_code == 503
    assert r.json() == {"ready": False}
    for leak in ("127.0.0.1:9", str(tmp_path), "spool", "ledger", "loop"):
        assert leak not in r.text, r.text


def test_with_the_token_readyz_lists_the_problems(tmp_path):
    c = _client(tmp_path, TOKEN)
    r = c.get("/readyz", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 503
    assert r.json()["ready"] is False and any("loop is not running" in p for p in r.json()["problems"])


def test_without_a_token_set_the_sidecars_own_token_is_needed_for_the_problems(tmp_path):
    c = _client(tmp_path, None)  # no HSSTREAM_API_TOKEN: the sidecar made one in its run dir
    assert c.get("/readyz").json() == {"ready": False}
    r = c.get("/readyz", headers={"authorization": f"Bearer {read_token(tmp_path / 'run')}"})
    assert r.status_code == 503 and r.json()["problems"]


def test_served_open_on_purpose_readyz_lists_the_problems(tmp_path):
    r = _client(tmp_path, None, allow_open=True).get("/readyz")
    assert r.status_code == 503 and r.json()["problems"]
    assert read_token(tmp_path / "run") is None  # served open: no token made
