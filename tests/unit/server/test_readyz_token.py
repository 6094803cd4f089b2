"""/readyz is open so that orchestrators need no credentials, but its problems name URLs, paths
and error text: without the token it says only whether the sidecar is ready; with the token (or
when no token is set) it lists the problems."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from connector.contract.settings import Settings
from server.app import create_app

TOKEN = "readyz-token"


def _client(tmp_path, token: str | None) -> TestClient:
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 api_token=token)  # fmt: skip
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


def test_without_a_token_set_readyz_lists_the_problems(tmp_path):
    r = _client(tmp_path, None).get("/readyz")
    assert r.status_code == 503 and r.json()["problems"]
