"""One real stack (vLLM CPU build + sidecar) per engine configuration, shared by a module.

An engine start costs ~40 s here, so tests are grouped by configuration: each module asks
for the stack it needs once.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hsstream.demo import Stack


def start_stack(model: str, layer_ids: list[int], *, prefix_caching: bool = False, env: dict | None = None,
                prefix: str = "hsstream-test-", max_model_len: int = 1024, engines: int = 1) -> Stack:
    """A started stack; ``env`` overrides the sidecar's and vLLM's HSSTREAM_* settings."""
    wd = Path(tempfile.mkdtemp(prefix=prefix))
    st = Stack(model, layer_ids, wd, prefix_caching=prefix_caching, max_model_len=max_model_len, engines=engines)
    st.env.update(env or {})
    try:
        st.start()
    except BaseException:
        stop_stack(st)
        raise
    return st


def stop_stack(st: Stack) -> None:
    st.stop()
    st.remove_spool()


@pytest.fixture(scope="module")
def stack_factory(tiny_model) -> Iterator:
    started: list[Stack] = []

    def make(layer_ids: list[int], **kw) -> Stack:
        st = start_stack(tiny_model, layer_ids, **kw)
        started.append(st)
        return st

    yield make
    for st in started:
        stop_stack(st)


def submit(stack: Stack, samples: list[dict], **options) -> str:
    r = httpx.post(f"{stack.api}/v1/jobs", json={"samples": samples, "options": options}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["job_id"]
