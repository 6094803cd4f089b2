"""An in-place draft swap behind the proxy, in a real vLLM (CPU), while a client streams.

The proxy runs its own engine (managed mode) with draft A and our weight-transfer backend; a
client streams through it one request after another and never retries; ``POST /admin/swap``
loads draft B into the live engine (vLLM's ``/start_draft_weight_update`` → ``/update_weights``
→ ``/finish_weight_update``) and a rollback goes back to A. No request fails or is cut, the
version in ``/metrics`` follows, each swap is in ``swaps.jsonl``, and the live draft's
parameters changed and came back exactly (the digests the engine logs around each load).
Needs the ``hsstream_draft_swap`` vLLM plug-in entry point (``pip install -e .`` after
pyproject.toml changed, as ``make`` does).
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.support.proxy_harness import proxy_settings, running_proxy


@pytest.fixture(scope="module")
def drafts(tiny_model, tmp_path_factory):
    from trainer_client.drafts import eagle3 as E3

    with open(f"{tiny_model}/config.json") as fh:
        vocab = json.load(fh)["vocab_size"]  # the full vocabulary: no maps
    out = []
    for seed in (1, 2):
        d = tmp_path_factory.mktemp(f"draft{seed}")
        E3.build_draft(tiny_model, [2, 6, 9], draft_vocab_size=vocab, t2d=None, d2t=None, seed=seed).save_pretrained(d)
        out.append(str(d))
    return out


def test_an_in_place_swap_and_its_rollback_fail_no_request(tiny_model, drafts, tmp_path):
    from hsstream import weight_swap
    from hsstream.proxy.engines import EngineManager

    a, b = drafts
    em = EngineManager(model=tiny_model, log_dir=tmp_path / "logs", served_model_name="served",
                       weight_transfer=weight_swap.WEIGHT_TRANSFER_CONFIG, ready_timeout_s=900)  # fmt: skip
    url, child = em.start(a, "A")
    try:
        s = proxy_settings(tmp_path, url, tee=False)
        with running_proxy(s, version="A", draft=a, engines=em) as p:
            p.app.upstreams.live.handle = child
            results: list = []
            stop = threading.Event()

            def client() -> None:
                with httpx.Client(timeout=300) as c:
                    while not stop.is_set():
                        try:
                            with c.stream("POST", p.url + "/v1/completions", json={
                                "model": "served", "prompt": "Once upon a time", "max_tokens": 32,
                                "temperature": 0, "ignore_eos": True, "stream": True}) as r:  # fmt: skip
                                body = b"".join(r.iter_bytes())
                            results.append(r.status_code == 200 and body.endswith(b"data: [DONE]\n\n"))
                        except httpx.HTTPError as e:
                            results.append(repr(e))

            t = threading.Thread(target=client)
            t.start()
            time.sleep(1.0)
            r = httpx.post(p.url + "/admin/swap", headers=p.admin_headers, timeout=600,
                           json={"draft": b, "version": "B", "mode": "in_place"})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["mode"] == "in_place" and r.json()["result"] == "done"
            time.sleep(1.0)
            stop.set()
            t.join(300)
            assert results and all(x is True for x in results), results  # none failed, none cut
            assert httpx.get(p.url + "/healthz").json()["live"] == "B"
            assert 'hsstream_proxy_draft_info{upstream="' + url + '",version="B"} 1.0' in httpx.get(p.url + "/metrics").text
            r = httpx.post(p.url + "/admin/rollback", headers=p.admin_headers, timeout=600)
            assert r.status_code == 200 and r.json()["to"] == "A", r.text
            r = httpx.post(p.url + "/v1/completions", timeout=300, json={"model": "served", "prompt": "Hi", "max_tokens": 4})
            assert r.status_code == 200 and httpx.get(p.url + "/healthz").json()["live"] == "A"
        engine_log = "".join(f.read_text(errors="replace") for f in (tmp_path / "logs").glob("*.log"))
        d = re.findall(r"hsstream_file: draft parameters (\w+) -> (\w+) \(version (\w+)", engine_log)
        assert [v for _, _, v in d] == ["B", "A"], d
        assert d[0][1] != d[0][0] and d[1][0] == d[0][1] and d[1][1] == d[0][0], d  # changed in place, and back
        log = [json.loads(x) for x in (tmp_path / "proxy-state" / "swaps.jsonl").read_text().splitlines()]
        assert [(x["from"], x["to"], x["result"]) for x in log] == [("A", "B", "done"), ("B", "A", "done")]
    finally:
        child.stop()
