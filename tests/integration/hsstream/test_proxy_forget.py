"""``hsstream proxy forget``: what the proxy teed is deleted from its store and purged from a real
sidecar (its traffic jobs cancelled and their rows gone at once). The upstream is a stub here:
what is under test is the tee's path into the sidecar and back out, not vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from aiohttp import web

from tests.integration.conftest import sidecar_without_vllm
from tests.support.proxy_harness import StubUpstream, proxy_settings, running_proxy

TOKEN = "forget-test-token"


async def _chat(_req, body):
    q = json.loads(body)["messages"][-1]["content"]
    return web.json_response({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": f"About {q}."},
                                           "finish_reason": "stop"}]})  # fmt: skip


def test_forget_deletes_the_store_and_purges_the_traffic_jobs(tiny_model, tmp_path, monkeypatch):
    from connector.contract.rest_client import SidecarClient, SidecarError

    monkeypatch.setenv("HSSTREAM_API_TOKEN", TOKEN)
    stub = StubUpstream({"/v1/chat/completions": _chat}).start()
    try:
        with sidecar_without_vllm(tiny_model, TOKEN, "hsstream-forget-") as sc:
            s = proxy_settings(tmp_path, stub.url, sidecar_url=sc.url, holdout_fraction=0.0, max_backlog=0)
            with running_proxy(s) as p:
                for i in range(3):
                    r = httpx.post(p.url + "/v1/chat/completions", timeout=60,
                                   json={"model": "m", "messages": [{"role": "user", "content": f"topic {i}"}]})  # fmt: skip
                    assert r.status_code == 200
                t0 = time.monotonic()
                while p.app.m.tee.labels("teed")._value.get() < 3:
                    assert time.monotonic() - t0 < 120, "the tee did not reach the sidecar"
                    time.sleep(0.1)
                with SidecarClient(sc.url, token=TOKEN) as c:
                    jobs = [j.job_id for j in c.jobs()]
                    assert sum(len(list(c.iter_job_samples(j))) for j in jobs) == 3
                # the command, as an operator runs it (state dir and admin token from the settings)
                env = {**os.environ, "HSSTREAM_PROXY_STATE_DIR": str(s.state_dir), "HSSTREAM_PROXY_PORT": str(s.port)}
                out = subprocess.run([sys.executable, "-m", "hsstream", "proxy", "forget", "--all"], env=env,
                                     capture_output=True, text=True, timeout=300)  # fmt: skip
                assert out.returncode == 0, out.stderr
                res = json.loads(out.stdout)
                assert sorted(res["purged_jobs"]) == sorted(jobs) and res["failed_jobs"] == []
                assert p.app.admin.store.counts() == {"seen": 0, "heldout": 0, "jobs": 0}
                with SidecarClient(sc.url, token=TOKEN) as c:
                    for j in jobs:
                        assert c.job(j).compacted
                        with pytest.raises(SidecarError) as e:
                            c.job_samples(j)
                        assert e.value.status == 410  # the token ids are gone
                bad = subprocess.run([sys.executable, "-m", "hsstream", "proxy", "forget"], env=env,
                                     capture_output=True, text=True, timeout=120)  # fmt: skip
                assert bad.returncode == 2 and "--all or --older-than" in bad.stderr
    finally:
        stub.stop()
