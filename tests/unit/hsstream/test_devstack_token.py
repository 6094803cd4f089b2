"""A stack's token is its sidecar's: asked for before the stack has started, it is an error, not
an empty token (a client made too early sent none and got 401; ``make soak`` broke that way)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hsstream.devstack import Stack


@pytest.fixture
def stack(tmp_path, monkeypatch) -> Iterator[Stack]:
    """A stack never started (its constructor makes its spool and run dir: removed after)."""
    monkeypatch.delenv("HSSTREAM_API_TOKEN", raising=False)
    st = Stack("model-dir", [1, 2], tmp_path)
    yield st
    st.stop()
    st.remove_spool()


def test_a_token_asked_for_before_start_is_an_error(stack):
    st = stack
    with pytest.raises(RuntimeError, match="after start"):
        st.client()
    with pytest.raises(RuntimeError, match="after start"):
        _ = st.headers


def test_a_token_set_in_the_stack_env_is_used_before_start(stack):
    st = stack
    st.env["HSSTREAM_API_TOKEN"] = "t0k"
    assert st.token == "t0k" and st.client_env({})["HSSTREAM_API_TOKEN"] == "t0k"
