"""The serving proxy against a stub upstream: what a real vLLM cannot be made to do on cue.

Errors pass through byte for byte, an unreachable vLLM is a 502 in vLLM's error shape, a client
that leaves (streaming or not) closes the request at the upstream (vLLM aborts on that), a
stream the upstream cuts reaches the client cut (never as a clean end), only the OpenAI routes
are forwarded, and both auth modes. Real uvicorn and real sockets on both sides.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from aiohttp import web

from tests.support.proxy_harness import StubUpstream, free_port, proxy_settings, running_proxy

STREAM_EVENTS = 40
ERR = b'{"error":{"message":"max_tokens must be at least 1, got -1.","type":"BadRequestError","param":"max_tokens","code":400}}'


async def _error(_req, _body):
    return web.Response(status=400, body=ERR, headers={"content-type": "application/json", "x-request-id": "abc"})


async def _slow_stream(req, _body):
    resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
    await resp.prepare(req)
    for i in range(STREAM_EVENTS):
        await resp.write(f'data: {{"i": {i}}}\n\n'.encode())
        await asyncio.sleep(0.05)
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _long_stream(req, _body):
    resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
    await resp.prepare(req)
    for i in range(600):
        await resp.write(f'data: {{"i": {i}}}\n\n'.encode())
        await asyncio.sleep(0.05)
    return resp


async def _slow_reply(_req, _body):
    await asyncio.sleep(30)
    return web.json_response({"late": True})


async def _cut_stream(req, _body):
    resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
    await resp.prepare(req)
    await resp.write(b'data: {"i": 0}\n\n')
    await asyncio.sleep(0.1)
    req.transport.close()  # vLLM dying mid-stream
    return resp


async def _echo_headers(req, body):
    return web.json_response({"headers": dict(req.headers), "body": body.decode()})


@pytest.fixture
def stub():
    s = StubUpstream({
        "/v1/completions": _error, "/v1/chat/completions": _slow_stream, "/v1/models": _echo_headers,
        "/slow": _slow_reply, "/cut": _cut_stream,
    }).start()  # fmt: skip
    yield s
    s.stop()


def test_an_upstream_error_reaches_the_client_byte_for_byte(stub, tmp_path):
    with running_proxy(proxy_settings(tmp_path, stub.url, tee=False)) as p:
        r = httpx.post(p.url + "/v1/completions", content=b'{"model": "m", "prompt": "x", "max_tokens": -1}',
                       headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.content == ERR
    assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"] == "abc"


def test_an_unreachable_upstream_is_a_502_in_vllms_error_shape(tmp_path):
    with running_proxy(proxy_settings(tmp_path, f"http://127.0.0.1:{free_port()}", tee=False)) as p:
        r = httpx.post(p.url + "/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == 502 and err["type"] == "BadGateway" and "did not answer" in err["message"]


def _raw_request(port: int, path: str, body: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
    return s


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions-slow"])
def test_a_client_that_leaves_closes_the_request_at_the_upstream(stub, tmp_path, path):
    """Streaming (the reply under way) and not (waiting for the reply's head): either way the
    upstream's handler is cancelled once the client's socket closes, the way vLLM aborts."""
    stub.routes["/v1/chat/completions"] = _long_stream
    with running_proxy(proxy_settings(tmp_path, stub.url, tee=False)) as p:
        if path == "/v1/completions-slow":  # a reply that takes long to come, under an OpenAI path
            stub.routes["/v1/completions"] = _slow_reply
            path = "/v1/completions"
        s = _raw_request(p.s.port, path, b'{"model": "m", "stream": true}')
        assert stub.wait_event(("start", path))
        if path == "/v1/chat/completions":
            assert s.recv(4096).startswith(b"HTTP/1.1 200")  # streaming has begun
        s.close()
        assert stub.wait_event(("cancelled", path), timeout=10), stub.events
        t0 = time.monotonic()
        while p.app.m.disconnects.labels("chat" if "chat" in path else "completions")._value.get() < 1:
            assert time.monotonic() - t0 < 5, "the disconnect was not counted"
            time.sleep(0.02)
        assert p.app.upstreams.live.in_flight == 0


def test_a_stream_the_upstream_cuts_reaches_the_client_cut(stub, tmp_path):
    stub.routes["/v1/chat/completions"] = _cut_stream
    with running_proxy(proxy_settings(tmp_path, stub.url, tee=False)) as p:
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", p.url + "/v1/chat/completions", json={"stream": True}) as r:
                assert r.status_code == 200
                for _ in r.iter_bytes():
                    pass
        assert p.app.m.upstream_errors.labels("cut")._value.get() == 1


def test_only_the_openai_routes_are_forwarded(stub, tmp_path):
    """vLLM's development routes (a dev-mode engine's weight updates, pause) and every other path
    are answered by the proxy, never forwarded; an OpenAI path with another method is a 405."""
    with running_proxy(proxy_settings(tmp_path, stub.url, tee=False)) as p:
        for method, path in (("GET", "/docs"), ("POST", "/start_draft_weight_update"), ("POST", "/pause"),
                             ("POST", "/v1/embeddings"), ("GET", "/health"), ("GET", "/v1/models/../../pause"),
                             ("POST", "/v1/chat/completions/x"), ("GET", "/openapi.json")):  # fmt: skip
            r = httpx.request(method, p.url + path)
            assert r.status_code == 404 and "forwards only" in r.json()["error"]["message"], (method, path)
        r2 = httpx.request("DELETE", p.url + "/v1/models")
        assert r2.status_code == 405 and r2.headers["allow"] == "GET"
    assert stub.requests == []


def test_without_its_own_key_the_clients_authorization_reaches_vllm_unchanged(stub, tmp_path):
    with running_proxy(proxy_settings(tmp_path, stub.url, tee=False)) as p:
        r = httpx.get(p.url + "/v1/models", headers={"authorization": "Bearer vllm-key", "x-custom": "1",
                                                      "connection": "keep-alive", "x-hsstream-private": "1"})  # fmt: skip
    h = {k.lower(): v for k, v in r.json()["headers"].items()}
    assert h["authorization"] == "Bearer vllm-key" and h["x-custom"] == "1"
    assert "x-hsstream-private" not in h  # the proxy's own header stays with the proxy


def test_with_its_own_key_the_proxy_checks_it_and_sends_vllms(stub, tmp_path):
    s = proxy_settings(tmp_path, stub.url, tee=False, api_key="proxy-key", upstream_api_key="vllm-key")
    with running_proxy(s) as p:
        for bad in ({}, {"authorization": "Bearer vllm-key"}, {"authorization": "Bearer proxy-ke"}):
            r = httpx.get(p.url + "/v1/models", headers=bad)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        assert stub.requests == []
        r = httpx.get(p.url + "/v1/models", headers={"authorization": "Bearer proxy-key"})
        assert r.status_code == 200
        assert r.json()["headers"]["Authorization"] == "Bearer vllm-key"
        assert httpx.get(p.url + "/metrics").status_code == 401
        assert httpx.get(p.url + "/metrics", headers={"authorization": "Bearer proxy-key"}).status_code == 200


def test_admin_routes_want_the_admin_token(stub, tmp_path):
    with running_proxy(proxy_settings(tmp_path, stub.url, tee=False)) as p:
        assert httpx.get(p.url + "/admin/state").status_code == 401
        assert httpx.get(p.url + "/admin/state", headers={"authorization": "Bearer nope"}).status_code == 401
        st = httpx.get(p.url + "/admin/state", headers=p.admin_headers).json()
        assert st["live"]["url"] == stub.url and st["live"]["version"] == "initial"
        tok = (tmp_path / "proxy-state" / "admin.token")
        assert tok.stat().st_mode & 0o777 == 0o600


def test_a_body_over_the_limit_is_413_and_never_forwarded(stub, tmp_path):
    with running_proxy(proxy_settings(tmp_path, stub.url, tee=False, max_body_bytes=2048)) as p:
        r = httpx.post(p.url + "/v1/completions", content=b"x" * 4096)
        assert r.status_code == 413 and "HSSTREAM_PROXY_MAX_BODY_BYTES" in r.json()["error"]["message"]
    assert stub.requests == []


def test_switching_upstreams_moves_new_requests_and_drains_the_old(stub, tmp_path):
    """POST /admin/upstream (blue/green with an engine the operator started): a stream under way
    on the old upstream ends whole, new requests go to the new one, the old is drained."""
    green = StubUpstream({"/v1/models": _echo_headers, "/v1/chat/completions": _slow_stream}).start()
    try:
        with running_proxy(proxy_settings(tmp_path, stub.url, tee=False)) as p:
            chunks: list[bytes] = []
            import threading

            def stream() -> None:
                with httpx.stream("POST", p.url + "/v1/chat/completions", json={"stream": True}, timeout=60) as r:
                    chunks.extend(r.iter_bytes())

            t = threading.Thread(target=stream)
            t.start()
            assert stub.wait_event(("start", "/v1/chat/completions"))
            r = httpx.post(p.url + "/admin/upstream", headers=p.admin_headers, timeout=60,
                           json={"url": green.url, "version": "v2"})  # fmt: skip
            t.join(30)
            assert r.status_code == 200, r.text
            rec = r.json()
            assert rec["result"] == "done" and rec["drained"] and rec["to"] == "v2" and rec["from"] == "initial"
            body = b"".join(chunks)
            assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") == STREAM_EVENTS + 1  # the old stream ended whole
            assert httpx.get(p.url + "/v1/models").status_code == 200
            assert [e for e in green.events if e[0] == "start"] == [("start", "/v1/models")] * 2  # the check + ours
            m = httpx.get(p.url + "/metrics").text
            assert 'hsstream_proxy_draft_info{upstream="' + green.url + '",version="v2"} 1.0' in m
            from hsstream.top import proxy_line

            assert str(proxy_line(p.url)).startswith("live draft  v2")  # what `hsstream top --proxy` shows
            assert "did not answer" in str(proxy_line(f"http://127.0.0.1:{free_port()}"))
            assert "initial" not in m.split("hsstream_proxy_draft_info")[-1].split("\n# ")[0]
            log = [json.loads(x) for x in (tmp_path / "proxy-state" / "swaps.jsonl").read_text().splitlines()]
            assert log[-1]["to"] == "v2" and log[-1]["result"] == "done"
            # a rollback goes back to the old upstream, which still answers
            r = httpx.post(p.url + "/admin/rollback", headers=p.admin_headers, timeout=60)
            assert r.status_code == 200 and r.json()["to"] == "initial", r.text
            assert httpx.get(p.url + "/healthz").json()["live"] == "initial"
    finally:
        green.stop()
