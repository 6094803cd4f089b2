"""An in-place draft swap behind the proxy, in a real vLLM (CPU), while a client streams.

The proxy runs its own engine (managed mode) with draft A and our weight-transfer backend; a
client streams through it one request after another and never retries; ``POST /admin/swap``
loads draft B into the live engine (vLLM's ``/start_draft_weight_update`` → ``/update_weights``
→ ``/finish_weight_update``) and a rollback goes back to A. No request fails or is cut, the
version in ``/metrics`` follows, each swap is in ``swaps.jsonl``, and the engine's own
counters change with the draft (B accepts differently from A on the same greedy prompts; A again
exactly as before). One engine for the module; needs the ``hsstream_draft_swap`` vLLM plug-in
entry point (``pip install -e .`` after pyproject.toml changed, as ``make`` does).
"""

from __future__ import annotations

import json
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


def _counts(url: str) -> tuple[float, float]:
    d, a = 0.0, 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:spec_decode_num_drafts_total"):
            d += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:spec_decode_num_accepted_tokens_total"):
            a += float(line.rsplit(" ", 1)[1])
    return d, a


def _measure(proxy: str, engine: str) -> tuple[float, float]:
    b = _counts(engine)
    for i in range(6):
        r = httpx.post(proxy + "/v1/completions", timeout=300, json={
            "model": "served", "prompt": f"The number {i} is", "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    a = _counts(engine)
    return a[0] - b[0], a[1] - b[1]


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
            before = _measure(p.url, url)
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
            with_b = _measure(p.url, url)
            r = httpx.post(p.url + "/admin/rollback", headers=p.admin_headers, timeout=600)
            assert r.status_code == 200 and r.json()["to"] == "A", r.text
            again = _measure(p.url, url)
        assert again == before and with_b != before, (before, with_b, again)  # the weights really changed, and back
        log = [json.loads(x) for x in (tmp_path / "proxy-state" / "swaps.jsonl").read_text().splitlines()]
        assert [(x["from"], x["to"], x["result"]) for x in log] == [("A", "B", "done"), ("B", "A", "done")]
    finally:
        child.stop()
