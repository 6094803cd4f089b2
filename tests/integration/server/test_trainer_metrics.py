"""A trainer's training report reaches the sidecar's ``/metrics`` and overview: a real
`hsstream serve` (uvicorn, no vLLM behind it), a real ``HiddenStateStream`` on its ZeroMQ
delivery socket. A peer's out-of-bounds report is dropped and counted, never a 5xx; a trainer
that goes silent takes its series with it."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import zmq

from connector import protocol as P
from tests.integration.conftest import sidecar_without_vllm
from trainer_client import HiddenStateStream

TOKEN = "metrics-token"
TIMEOUT_S = 3.0  # HSSTREAM_TRAINER_TIMEOUT_S: how long a silent trainer keeps its series


@pytest.fixture(scope="module")
def sidecar(tiny_model):
    with sidecar_without_vllm(tiny_model, TOKEN, "hsstream-tmetrics-", HSSTREAM_TRAINER_TIMEOUT_S=str(TIMEOUT_S)) as sc:
        yield sc


def _client(sc) -> httpx.Client:  # noqa: ANN001
    return httpx.Client(base_url=sc.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)


def _series(text: str, name: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{name}{{trainer="([0-9a-f]+)"}} (\S+)$', text, re.M)}


def _metrics(c: httpx.Client) -> str:
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    return r.text


def test_a_report_sent_through_the_stream_shows_in_metrics_until_the_trainer_goes(sidecar):
    ep = f"ipc://{sidecar.env['HSSTREAM_RUN_DIR']}/delivery.sock"
    with _client(sidecar) as c:
        assert _series(_metrics(c), "hsstream_trainer_loss") == {}
        with HiddenStateStream(ep, jobs=["none-yet"], follow=True, spool_dir=sidecar.env["HSSTREAM_SPOOL_DIR"],
                               idle_s=0.5, heartbeat_s=0.1, timeout_s=60) as s:  # fmt: skip
            it = iter(s)
            s.report(step=41, loss=1.75, steps_per_s=2.5, samples_per_s=20.0)
            t_end, text = time.monotonic() + 20, ""
            while "hsstream_trainer_wait_share{" not in text and time.monotonic() < t_end:
                assert next(it) is None  # idle (nothing submitted); the stream heartbeats meanwhile
                text = _metrics(c)
            loss = _series(text, "hsstream_trainer_loss")
            (tid,) = loss
            assert loss == {tid: 1.75}
            assert _series(text, "hsstream_trainer_step") == {tid: 41.0}
            assert _series(text, "hsstream_trainer_steps_per_second") == {tid: 2.5}
            assert _series(text, "hsstream_trainer_samples_per_second") == {tid: 20.0}
            # The stream's own figure: 0.5 s waiting in it per /metrics GET outside it (which would
            # have to take 2 s to bring the share under 0.2).
            share = _series(text, "hsstream_trainer_wait_share")
            assert list(share) == [tid] and 0.2 < share[tid] <= 1.0, share
            (t,) = c.get("/v1/overview").json()["trainers"]
            assert t["id"] == tid and t["train"] == {"step": 41, "loss": 1.75, "steps_per_s": 2.5,
                                                     "samples_per_s": 20.0}  # fmt: skip
            # A peer's report out of its bounds: dropped and counted; the figures stay, no 5xx.
            bad = zmq.Context.instance().socket(zmq.DEALER)
            bad.setsockopt(zmq.LINGER, 0)
            bad.connect(ep)
            before = c.get("/v1/stats").json()["delivery"]["bad_messages"]
            for train in ('{"step": 1, "loss": NaN}', '{"step": 1, "loss": -1}', '{"step": 1, "loss": 1e300}'):
                bad.send_multipart([b"HEARTBEAT", f'{{"v": {P.PROTOCOL_VERSION}, "alive_s": 1, "train": {train}}}'.encode()])
            bad.send_multipart([b"HEARTBEAT", json.dumps({"v": P.PROTOCOL_VERSION, "train": {"step": "1" * 5000}}).encode()])
            t_end = time.monotonic() + 10
            while c.get("/v1/stats").json()["delivery"]["bad_messages"] < before + 4 and time.monotonic() < t_end:
                next(it)
            bad.close(linger=0)
            assert c.get("/v1/stats").json()["delivery"]["bad_messages"] == before + 4
            assert _series(_metrics(c), "hsstream_trainer_loss") == {tid: 1.75}
        # Closed: silent from now on, dropped after HSSTREAM_TRAINER_TIMEOUT_S, with its series.
        t_end = time.monotonic() + TIMEOUT_S + 10
        while tid in (text := _metrics(c)) and time.monotonic() < t_end:
            time.sleep(0.2)
        assert tid not in text and "hsstream_trainers_connected 0.0" in text
