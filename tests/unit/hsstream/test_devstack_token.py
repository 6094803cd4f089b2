"""A development stack's token is its sidecar's: asked for before the stack has started, it is an
error, not an empty token (a client made too early sent none and got 401; ``make soak`` broke that
way). The rule is ``hsstream.devstack.stack_token``, which the stack's ``token``, ``headers``,
``client()`` and ``client_env()`` all go through."""

from __future__ import annotations

import pytest

from connector.contract.api_token import ensure_token
from hsstream.devstack import stack_token


def test_a_token_asked_for_before_start_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HSSTREAM_API_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="after start"):
        stack_token({}, tmp_path / "run", started=False)


def test_after_start_the_sidecars_token_is_read_and_an_env_token_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("HSSTREAM_API_TOKEN", raising=False)
    run = tmp_path / "run"
    made = ensure_token(run)  # what the sidecar does as it starts
    assert stack_token({}, run, started=True) == made
    assert stack_token({}, run, started=False) == made  # written already: nothing to refuse
    assert stack_token({"HSSTREAM_API_TOKEN": "t0k"}, tmp_path / "none", started=False) == "t0k"
    assert stack_token({}, tmp_path / "none", started=True) == ""  # started, serving open
