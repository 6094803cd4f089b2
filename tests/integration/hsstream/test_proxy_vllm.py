"""The serving proxy in front of a real vLLM (CPU build), teeing into a real sidecar.

Each case is checked two ways, streamed or not, ``n>1``, tools, ``stream_options.include_usage``
and vLLM's own errors:

* what the client got through the proxy is byte for byte what vLLM put on the wire for that
  request (a recording relay between the proxy and vLLM): status, body, every header but the
  hop-by-hop ones (each connection's own);
* it equals a request sent straight to vLLM with the same body (seeded, or temperature 0) and
  the same ``X-Request-Id`` (vLLM names its reply after it), byte for byte but the ``created``
  second and the ``date`` header (the two requests are not sent in the same second).
 Then what the tee sent: the sidecar
holds one traffic sample per distinct successful request, tokenised by the sidecar itself
with the reply under the loss mask; a private request is not among them. Then the same cases
with the sidecar dead: the clients get the same bytes, the tee counts its dropped batch.

One vLLM engine and one sidecar (without an engine: admission needs none) for the module.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from hsstream.proxy.engines import EngineManager
from tests.conftest import prestarted
from tests.integration.conftest import sidecar_without_vllm, tiny
from tests.support.proxy_harness import proxy_settings, running_proxy
from tests.support.recording_relay import RecordingRelay

TOKEN = "proxy-test-token"
MODEL = "verifier"

CASES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}],
                                      "max_tokens": 12, "temperature": 0}),
    "chat_stream_usage": ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Count to five."}],
                                                   "max_tokens": 12, "temperature": 0, "stream": True,
                                                   "stream_options": {"include_usage": True}}),
    "chat_n2_seeded": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}],
                                                "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}),
    "chat_tools": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 10, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "none"}),
    "completion": ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}),
    "completion_stream_n2": ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8,
                                                 "seed": 3, "n": 2, "stream": True}),
    "private": ("/v1/completions", {"prompt": "My secret recipe is", "max_tokens": 6, "temperature": 0}),
    "error_unknown_model": ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
    "error_bad_max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
}
TEED_CASES = ("chat", "chat_stream_usage", "chat_n2_seeded", "chat_tools", "completion", "completion_stream_n2")


def _start():
    import tempfile

    em = EngineManager(model=tiny(), log_dir=Path(tempfile.mkdtemp(prefix="hsstream-proxy-engine-")),
                       served_model_name=MODEL, ready_timeout_s=600)  # fmt: skip
    url, child = em.start(None, "v0")
    return em, url, child


PRESTART = {"engine": (_start, lambda e: e[0].stop(e[2]))}  # tests/support/prestart.py


@pytest.fixture(scope="module")
def engine():
    em, url, child = prestarted(__name__, "engine")
    yield url
    em.stop(child)


@pytest.fixture
def relay(engine):
    r = RecordingRelay(int(engine.rsplit(":", 1)[1]))
    yield r
    r.close()


@pytest.fixture(scope="module")
def sidecar(tiny_model):
    with sidecar_without_vllm(tiny_model, TOKEN, "hsstream-proxy-") as sc:
        yield sc


def _send(base: str, name: str, headers: dict | None = None) -> httpx.Response:
    path, body = CASES[name]
    body = {"model": MODEL, **body}
    h = {"content-type": "application/json", "x-request-id": f"req-{name}-{time.time_ns()}", **(headers or {})}
    return httpx.post(base + path, content=json.dumps(body).encode(), headers=h, timeout=120)


HOP = {b"connection", b"keep-alive", b"transfer-encoding"}


def _pair(direct: str, proxy, relay, name: str, headers: dict | None = None) -> tuple[httpx.Response, httpx.Response]:  # noqa: ANN001
    """The same request straight and through the proxy; the proxied reply checked against the
    bytes vLLM sent for it (the relay's record of the one new response)."""
    rid = f"req-{name}-{time.time_ns()}"
    a = _send(direct, name, {"x-request-id": rid, **(headers or {})})
    before = set(relay.responses())
    b = _send(proxy.url, name, {"x-request-id": rid, **(headers or {})})
    new = [v for k, v in relay.responses().items() if k not in before]
    assert len(new) == 1, f"{name}: {len(new)} responses from vLLM for one request"
    wire = new[0]
    assert (b.status_code, b.content) == (wire["status"], wire["body"]), f"{name}: not what vLLM sent"
    got = [(k.lower(), v) for k, v in b.headers.raw if k.lower() not in HOP]
    assert got == [(k.lower(), v) for k, v in wire["headers"] if k.lower() not in HOP], name
    return a, b


CREATED = re.compile(rb'"created":\d+')


def _headers(r: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in r.headers.raw if k.lower() != b"date"]


def _by_choice(body: bytes) -> dict:
    """A stream's events (``created`` zeroed) in order per choice index: with ``n>1`` vLLM
    interleaves the choices' events in whatever order its step produced them, run to run."""
    out: dict = {}
    for ev in body.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            choices = json.loads(ev[6:]).get("choices") or [{"index": "usage"}]
            out.setdefault(choices[0].get("index"), []).append(CREATED.sub(b'"created":0', ev))
        elif ev:
            out.setdefault("other", []).append(ev)
    return out


def _assert_same(a: httpx.Response, b: httpx.Response, name: str) -> None:
    """Straight vs proxied: the same but the second each was made in (``created``, ``date``);
    a stream of several choices event for event per choice."""
    assert a.status_code == b.status_code, name
    ca, cb = CREATED.sub(b'"created":0', a.content), CREATED.sub(b'"created":0', b.content)
    if ca != cb and b"text/event-stream" in a.headers.get("content-type", "").encode() and b'"index":1' in ca:
        ca, cb = _by_choice(a.content), _by_choice(b.content)  # type: ignore[assignment]
    assert ca == cb, f"{name}: bodies differ\nvLLM:  {a.content[:400]!r}\nproxy: {b.content[:400]!r}"
    assert _headers(a) == _headers(b), name


def _wait(pred, timeout: float = 30.0) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.1)


def test_responses_pass_through_byte_for_byte_and_the_tee_reaches_the_sidecar(engine, relay, sidecar, tmp_path,
                                                                             monkeypatch):
    from connector.contract.rest_client import SidecarClient
    from connector.contract.sample_tokens import load_tokenizer

    monkeypatch.setenv("HSSTREAM_API_TOKEN", TOKEN)  # how SidecarClient finds the sidecar's token
    s = proxy_settings(tmp_path, relay.url, sidecar_url=sidecar.url, holdout_fraction=0.0, max_backlog=100)
    with running_proxy(s) as p:
        for name in CASES:
            if name == "private":
                continue
            a, b = _pair(engine, p, relay, name)
            _assert_same(a, b, name)
            if name.startswith("error"):
                assert a.status_code in (400, 404), (name, a.status_code)
            else:
                assert a.status_code == 200, (name, a.text)
        stream = _pair(engine, p, relay, "chat_stream_usage")[1].content
        assert b'"usage":{' in stream.split(b"data: [DONE]")[0].rsplit(b"data: ", 1)[-1]  # include_usage's last chunk
        # a private request: answered the same, never teed
        a, b = _pair(engine, p, relay, "private", {"x-hsstream-private": "1"})
        _assert_same(a, b, "private")
        m = p.app.m.tee
        _wait(lambda: m.labels("teed")._value.get() + m.labels("duplicate")._value.get() >= len(TEED_CASES) + 1)
        assert m.labels("private")._value.get() == 1
        assert m.labels("teed")._value.get() == len(TEED_CASES)  # the stream sent again: a duplicate
        assert m.labels("not_ok")._value.get() == 2  # the two errors, sampled but not 200

    with SidecarClient(sidecar.url, token=TOKEN) as c:
        jobs = [j.job_id for j in c.jobs()]
        rows = [smp for j in jobs for smp in c.iter_job_samples(j)]
    assert len(rows) == len(TEED_CASES) and all(r.id.startswith("traffic-") for r in rows)
    tok = load_tokenizer(str(Path(sidecar.env["HSSTREAM_MODEL"])))
    texts = {tok.decode(r.token_ids): r for r in rows}
    chat = next(r for t, r in texts.items() if "Name three colours." in t)
    first = chat.loss_mask.index(1)
    reply = tok.decode(chat.token_ids[first:])
    direct = _send(engine, "chat").json()["choices"][0]["message"]["content"]
    assert reply.startswith(direct), (reply, direct)  # the reply vLLM wrote is what carries the loss
    assert "<|im_start|>user" in tok.decode(chat.token_ids[:first]) and not any(chat.loss_mask[:first])
    comp = next(r for t, r in texts.items() if t.startswith("The capital of France is"))
    assert all(comp.loss_mask) and len(comp.token_ids) > 5
    assert not any("secret recipe" in t for t in texts)  # the private request never left the proxy


def test_with_the_sidecar_dead_clients_get_the_same_bytes_and_the_tee_drops(engine, relay, sidecar, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("HSSTREAM_API_TOKEN", TOKEN)
    sidecar.child.stop()
    s = proxy_settings(tmp_path, relay.url, sidecar_url=sidecar.url, holdout_fraction=0.0, max_backlog=100)
    with running_proxy(s) as p:
        for name in ("chat", "chat_stream_usage", "completion_stream_n2"):
            a, b = _pair(engine, p, relay, name)
            _assert_same(a, b, name)
        m = p.app.m.tee
        _wait(lambda: m.labels("sidecar_down")._value.get() >= 3)
        assert m.labels("teed")._value.get() == 0
