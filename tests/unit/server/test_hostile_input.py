"""Input that once became a 500: numbers past what SQLite or an int32 holds, non-finite numbers
(NaN, Infinity, 1e400, which Python's JSON reads as infinity) in a body that fails validation
(the 422 echoed them and the encoder refused), and token ids no vocabulary has. All are 4xx
with a readable message, and a non-finite number is never echoed."""

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


def _post(client, body: str):
    return client.post("/v1/jobs", content=body.encode(), headers={"content-type": "application/json"})


@pytest.fixture
def job(client) -> str:
    r = _post(client, '{"samples": [{"token_ids": [1, 2, 3]}]}')
    assert r.status_code == 200, r.text
    return r.json()["job_id"]


@pytest.mark.parametrize("offset", ["9223372036854775808", "99999999999999999999999", "-1"])
def test_an_errors_offset_past_any_integer_is_a_422(client, job, offset):
    r = client.get(f"/v1/jobs/{job}", params={"errors_offset": offset})
    assert r.status_code == 422, r.text


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
@pytest.mark.parametrize(
    "template",
    ['{"samples": [{"token_ids": [1]}], "options": {"epochs": %s}}',
     '{"samples": [{"token_ids": [1]}], "options": {"mode": "regenerate", "sampling": {"temperature": %s}}}',
     '{"samples": [{"token_ids": [1]}], "options": {"seed": %s}}',
     '{"samples": [{"token_ids": [1, %s]}]}',
     '{"samples": [{"messages": [{"role": "user", "content": "x", "weight": %s}]}]}',
     '{"samples": [{"prompt": "x"}], "extra": %s}',
     '{"samples": %s}'],
)  # fmt: skip
def test_non_finite_numbers_are_a_422_that_does_not_echo_them(client, template, bad):
    r = _post(client, template % bad)
    assert r.status_code == 422, r.text
    assert "NaN" not in r.text and "Infinity" not in r.text and "inf" not in r.text.replace("info", "")


@pytest.mark.parametrize("ids", ["[2147483648]", "[-1]", "[1, 99999999999999999999]", "[9223372036854775808]",
                                 "[true]", '["1"]', "[1.0]", "[1, false]"])  # fmt: skip
def test_token_ids_outside_int32_or_negative_are_a_422(client, ids):
    """Without a tokenizer there is no vocabulary to check against: 0 <= id < 2^31 still holds,
    and an id is a JSON integer (not a boolean, a string or a float that happens to be whole)."""
    r = _post(client, '{"samples": [{"token_ids": %s}]}' % ids)
    assert r.status_code == 422, r.text


@pytest.mark.parametrize(
    "options",
    ['{"seed": 99999999999999999999999}', '{"max_tokens_per_sample": 99999999999999999999}',
     '{"mode": "regenerate", "sampling": {"seed": 99999999999999999999}}'],
)  # fmt: skip
def test_integers_past_64_bits_in_options_are_a_422(client, options):
    r = _post(client, '{"samples": [{"token_ids": [1]}], "options": %s}' % options)
    assert r.status_code == 422, r.text
