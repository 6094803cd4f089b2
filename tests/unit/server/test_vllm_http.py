"""The submitter's aiohttp client against real local HTTP servers: what each way a vLLM can fail
looks like at the seam, and what the submitter then does with the sample (real ledger)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from server.ledger import Ledger, NewSample, State
from server.submitter import Submitter
from server.vllm_http import AiohttpClient, BadResponse, TimedOut, Unreachable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Vllm:
    """A real HTTP server (aiohttp.web on 127.0.0.1) whose completions answer as told."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.bodies: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if self.mode == "slow":
            await asyncio.sleep(2)
        if self.mode == "drop":  # the server dies mid-request: the connection closes, no answer
            request.transport.close()
            await asyncio.sleep(1)
        if self.mode in ("400", "500"):
            return web.Response(status=int(self.mode), text=f"error {self.mode} from the stand-in")
        return web.json_response({"choices": [{"text": "x"}]})

    async def __aenter__(self) -> Vllm:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self.runner.setup()
        port = _free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        # asyncio's Server.wait_closed (3.11) waits for every accepted connection to go: one the
        # client's loop left open (a timed-out request's, its loop gone on another thread) held
        # this stand-in's shutdown past pytest's 15 min limit once in `make test`. Bounded here.
        try:
            await asyncio.wait_for(self.runner.cleanup(), 10)
        except TimeoutError:
            pass


async def _garbage_server() -> tuple[asyncio.AbstractServer, str]:
    """Answers every request with bytes that are not HTTP."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"HTTP/1.1 abc not-a-status\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_the_client_maps_each_failure_to_the_seams_errors():
    async def go() -> None:
        c = AiohttpClient(timeout_s=10)  # answers must come in time on a loaded 2-core host
        short = AiohttpClient(timeout_s=0.5)  # the default timeout, against a server that sleeps 2 s
        try:
            async with Vllm() as v:
                r = await c.post_json(f"{v.url}/v1/completions", {"prompt": [1, 2, 3], "x": None})
                assert r.status_code == 200 and r.json() == {"choices": [{"text": "x"}]}
                assert v.bodies == [{"prompt": [1, 2, 3], "x": None}]
                for code in ("400", "500"):  # an HTTP error is an answer, not an exception
                    v.mode = code
                    r = await c.post_json(f"{v.url}/v1/completions", {"prompt": [1]})
                    assert r.status_code == int(code) and f"error {code} from the stand-in" in r.text
                v.mode = "slow"
                with pytest.raises(TimedOut, match="within 0.5 s"):
                    await short.post_json(f"{v.url}/v1/completions", {"prompt": [1]})
                with pytest.raises(TimedOut, match="within 0.2 s"):
                    await c.post_json(f"{v.url}/v1/completions", {"prompt": [1]}, timeout=0.2)
                v.mode = "drop"
                with pytest.raises(Unreachable, match="Disconnected|Connection"):
                    await c.post_json(f"{v.url}/v1/completions", {"prompt": [1]})
            with pytest.raises(Unreachable, match="Connect"):  # nothing listens there any more
                await c.get(f"{v.url}/v1/models")
            server, url = await _garbage_server()
            async with server:
                with pytest.raises(BadResponse):
                    await c.get(f"{url}/v1/models")
        finally:
            await c.aclose()
            await short.aclose()

    asyncio.run(go())


def _run(sub: Submitter, until, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    """Run the submitter (its own event loop, in this thread) until ``until(sub)`` holds."""

    async def go() -> None:
        await sub.start()
        try:
            t0 = asyncio.get_running_loop().time()
            while not until(sub):
                assert asyncio.get_running_loop().time() - t0 < timeout_s, "condition not reached"
                await asyncio.sleep(0.02)
        finally:
            await sub.stop()

    asyncio.run(go())


def _against(mode: str, sub_for, until) -> Submitter:  # noqa: ANN001
    """A submitter (made by ``sub_for(url)``) against a real server in ``mode``, on its own thread
    so the server's loop and the submitter's loop both run."""

    async def serve() -> Submitter:
        async with Vllm(mode) as v:
            sub = sub_for(v.url)
            await asyncio.to_thread(_run, sub, until)
            return sub

    return asyncio.run(serve())


@pytest.mark.parametrize("code", ["400", "500"])
def test_a_vllm_error_answer_spends_an_attempt_each_time_and_fails_the_sample_with_it(code):
    led = Ledger(max_attempts=3)
    job = led.add_job([NewSample([5, 6, 7], None, "s", 100)])
    sub = _against(code, lambda url: Submitter(led, url, budget_bytes=10**9),
                   lambda _s: led.job_view(job.job_id).done)  # fmt: skip
    (s,) = led.job_samples(job.job_id)
    assert s.state == State.failed and len(s.errors) == 3, s.errors
    assert all(f"vLLM answered {code}: error {code} from the stand-in" in e for e in s.errors)
    assert sub.stats["http_errors"] == 3 and sub.stats["vllm_down_retries"] == 0


def test_a_refused_connection_spends_no_attempt_and_marks_the_engine_down():
    led = Ledger(max_attempts=1)
    job = led.add_job([NewSample([5, 6, 7], None, "s", 100)])
    sub = Submitter(led, f"http://127.0.0.1:{_free_port()}", budget_bytes=10**9)  # nothing listens there
    _run(sub, lambda s: not s.engines[0].up and s.engines[0].failures >= 1)
    (s,) = led.job_samples(job.job_id)
    assert s.state == State.queued and s.errors == []  # waits for vLLM with its attempt intact


def test_a_timed_out_request_is_requeued_without_an_attempt():
    led = Ledger(max_attempts=1)
    job = led.add_job([NewSample([5, 6, 7], None, "s", 100)])
    sub = _against("slow", lambda url: Submitter(led, url, budget_bytes=10**9, timeout_s=0.3),
                   lambda s: s.stats["vllm_down_retries"] >= 1)  # fmt: skip
    (s,) = led.job_samples(job.job_id)
    assert s.errors == [] and s.state != State.failed, s  # max_attempts=1: one spent attempt would fail it
    assert s.attempt >= 1  # the timed-out request's answer, if it ever came, would not count
