"""One real stack (vLLM CPU build + sidecar) per engine configuration, shared by a module.

An engine start costs ~25-40 s here, so tests are grouped by configuration: each module asks
for the stack it needs once, most through a ``PRESTART`` entry that starts it while the module
before runs (tests/support/prestart.py).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hsstream import launch
from hsstream.devstack import Stack, free_port


def start_stack(model: str, layer_ids: list[int], *, prefix_caching: bool = False, env: dict | None = None,
                prefix: str = "hsstream-test-", max_model_len: int = 1024, engines: int = 1,
                base_env: dict | None = None) -> Stack:
    """A started stack; ``env`` overrides the sidecar's and vLLM's HSSTREAM_* settings; ``base_env``:
    the environment its children start from (default: this process's; a prestart gives the session's)."""
    wd = Path(tempfile.mkdtemp(prefix=prefix))
    st = Stack(model, layer_ids, wd, prefix_caching=prefix_caching, max_model_len=max_model_len, engines=engines,
               base_env=base_env)  # fmt: skip
    st.env.update(env or {})
    try:
        st.start()
    except BaseException:
        stop_stack(st)
        raise
    return st


def tiny() -> str:
    """The tiny verifier's path (the ``tiny_model`` fixture's, for a start function run ahead)."""
    from hsstream.tiny_model import build_tiny_verifier

    return str(build_tiny_verifier())


def stack_fixture(module: str, key: str = "stack"):  # noqa: ANN201 - a pytest fixture
    """A module-scoped fixture: the stack ``module``'s ``PRESTART[key]`` starts (started ahead where it
    was: tests/support/prestart.py), stopped at the module's end. ``stack = stack_fixture(__name__)``."""
    from tests.conftest import prestarted

    @pytest.fixture(scope="module")
    def fixture():  # noqa: ANN202
        st = prestarted(module, key)
        try:
            yield st
        finally:
            stop_stack(st)

    return fixture


def stop_stack(st: Stack) -> None:
    st.stop()
    st.remove_spool()


def submit(stack: Stack, samples: list[dict], **options) -> str:
    r = httpx.post(f"{stack.api}/v1/jobs", json={"samples": samples, "options": options}, timeout=60,
                   headers=stack.headers)
    assert r.status_code == 200, r.text
    return r.json()["job_id"]


#: Long enough for the reaper (60 s grace, a pass every 10 s) to take what a killed process left.
REAPER_WAIT_S = 90.0


def wait_spool_empty(stack: Stack, timeout: float = REAPER_WAIT_S) -> list[str]:
    """The spool's files once it is empty, or what is left after ``timeout``. A wait, not a
    fixed sleep: deletes after a job ends (RECEIVED, late notices of aborted requests, the
    reaper's pass) take longer on a loaded machine; an empty spool returns at once."""
    t0 = time.monotonic()
    while (left := stack.spool_files()) and time.monotonic() - t0 < timeout:
        time.sleep(0.1)
    # The arena layout: no slot still held (a quarantined one is free, only not yet reusable).
    while not left and stack.held_slots() and time.monotonic() - t0 < timeout:
        time.sleep(0.1)
    if not left and stack.held_slots():
        left = [f"{stack.held_slots()} arena slot(s) still held"]
    return left


@dataclass(frozen=True)
class LoneSidecar:
    url: str
    port: int
    env: dict[str, str]
    child: launch.Child
    log: Path


@contextlib.contextmanager
def sidecar_without_vllm(model: str, token: str, spool_prefix: str, **settings: str) -> Iterator[LoneSidecar]:
    """A real `hsstream serve` (uvicorn) with nothing listening at its vLLM URL: the dead-vLLM
    case, and all that checks of the REST surface need, without an engine start.
    ``settings`` add or override the sidecar's HSSTREAM_* environment."""
    run = Path(tempfile.mkdtemp(prefix="hsstream-run-"))
    spool = Path(tempfile.mkdtemp(prefix=spool_prefix, dir="/dev/shm"))
    port = free_port()
    env = launch.child_env({
        "HSSTREAM_SPOOL_DIR": str(spool), "HSSTREAM_RUN_DIR": str(run), "HSSTREAM_PORT": str(port),
        "HSSTREAM_MODEL": model, "HSSTREAM_LAYER_IDS": "2,6,9,12",
        "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "HSSTREAM_API_TOKEN": token, **settings,
    })  # fmt: skip
    child = launch.spawn("sidecar", [sys.executable, "-m", "hsstream", "serve"], env, run / "sidecar.log")
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_http(f"{url}/healthz", child, 180)  # its imports alone take a minute on a loaded 2-core host
        yield LoneSidecar(url, port, env, child, run / "sidecar.log")
    finally:
        child.stop()
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(spool, ignore_errors=True)
