"""The LR schedule spans the run's real length when no ``--steps`` bounds it.

``hsstream train --submit`` (and compose) run until the jobs are complete, so the length of the
cosine decay has to come from the jobs: their sample count, every epoch counted, over the
samples one step takes. ``run_train`` is driven with the sidecar's REST calls, the stream and the
trainer replaced, so what is checked is the configuration the trainer would have been built with.
"""

from __future__ import annotations

import json

import httpx
import pytest

from connector.contract.rest import JobStatus
from connector.contract.rest_client import SidecarClient
from trainer_client.train import run as R
from trainer_client.train import vocab as V
from trainer_client.train.config import TrainConfig
from trainer_client.train.step import lr_lambda


@pytest.fixture
def captured(monkeypatch):
    """run_train with a fake sidecar (jobs of known sizes), stream and trainer: the cfg it built."""
    got: dict = {}
    sizes = {"j-sub": None, "j1": 30, "j2": 10}
    submitted: list[dict] = []

    def fake_submit(api, samples, options=None, token=None, filename=None):  # noqa: ANN001, ANN202
        n = sum(1 for _ in samples)  # an iterator: the upload streams it
        submitted.append({"n": n, **(options or {})})
        sizes["j-sub"] = n * (options or {}).get("epochs", 1)  # the sidecar's num_samples
        return "j-sub"

    def sidecar(request: httpx.Request) -> httpx.Response:  # GET /v1/jobs/{id}, as the contract has it
        if got.get("gone"):
            raise httpx.ConnectError("gone", request=request)
        job = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        if job not in sizes:
            return httpx.Response(404, json={"detail": "no such job"})
        return httpx.Response(200, json=JobStatus(
            job_id=job, done=False, counts={"queued": sizes[job]}, num_samples=sizes[job], tokens_consumed=0,
            bytes_consumed=0, elapsed_s=1.0, tokens_per_s=0.0, errors=[], errors_total=0, errors_offset=0,
        ).model_dump(mode="json"))  # fmt: skip

    class FakeTrainer:
        def __init__(self, cfg, counts, **kw) -> None:  # noqa: ANN001, ANN003
            got["cfg"] = cfg

        def prepare(self) -> None:
            pass

        def stream_options(self) -> dict:
            return {}

        def train(self, stream):  # noqa: ANN001, ANN202
            class Res:
                def summary(self) -> dict:
                    return {}

            return Res()

    class FakeStream:
        def __init__(self, *a, **kw) -> None:  # noqa: ANN002, ANN003
            pass

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            pass

    import trainer_client.stream as S

    monkeypatch.setattr(R, "submit_job", fake_submit)
    monkeypatch.setattr(SidecarClient, "http_factory",
                        lambda **kw: httpx.Client(transport=httpx.MockTransport(sidecar), base_url=kw["base_url"]))
    monkeypatch.setattr(V, "token_counts_from_sidecar", lambda *a, **kw: {1: 1})
    monkeypatch.setattr(R, "OnlineTrainer", FakeTrainer)
    monkeypatch.setattr(S, "HiddenStateStream", FakeStream)
    got["submitted"] = submitted
    return got


def _run(tmp_path, cfg: TrainConfig, **kw) -> None:  # noqa: ANN003
    R.run_train(cfg, api="http://sidecar", endpoint="tcp://x", spool_dir=str(tmp_path / "spool"), **kw)


def _cfg(tmp_path, **kw) -> TrainConfig:  # noqa: ANN003
    return TrainConfig(verifier="unused", out_dir=str(tmp_path / "run"), device="cpu", warmup_steps=2, **kw)


def test_cosine_without_steps_decays_over_the_submitted_jobs_samples_times_epochs(captured, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(20)))
    _run(tmp_path, _cfg(tmp_path, samples_per_step=2), submit_file=str(data), epochs=2)
    cfg = captured["cfg"]
    f = lr_lambda(cfg)
    run_steps = 20 * 2 // 2  # 20 samples, 2 epochs, 2 samples a step
    assert f(run_steps * 3 // 4) < 0.5, "LR at 3/4 of the run must be well below the peak (cosine)"
    assert f(run_steps - 1) == pytest.approx(cfg.min_lr_ratio, abs=0.02)
    mid = cfg.warmup_steps + (run_steps - cfg.warmup_steps) // 2  # halfway through the decay
    assert f(mid) == pytest.approx(0.5 * (1 + cfg.min_lr_ratio), abs=0.01)


def test_followed_jobs_sizes_come_from_the_sidecar_and_the_length_is_kept_on_resume(captured, tmp_path):
    _run(tmp_path, _cfg(tmp_path, samples_per_step=4), jobs=["j1", "j2"])
    assert captured["cfg"].schedule_steps == 10  # (30 + 10) / 4
    # the restarted run follows the same jobs; its schedule must not change, even if the sidecar is gone
    captured["gone"] = True
    _run(tmp_path, _cfg(tmp_path, samples_per_step=4), jobs=["j1", "j2"])
    assert captured["cfg"].schedule_steps == 10


def test_the_held_out_fraction_is_not_counted_in_the_schedules_length(captured, tmp_path):
    _run(tmp_path, _cfg(tmp_path, samples_per_step=4, eval_fraction=0.25), jobs=["j1", "j2"])
    assert captured["cfg"].schedule_steps == 8  # (30 + 10) x 0.75 / 4: the held-out quarter is never trained


def test_steps_or_schedule_steps_given_win(captured, tmp_path):
    _run(tmp_path, _cfg(tmp_path, max_steps=7), jobs=["j1"])
    assert captured["cfg"].schedule_steps is None and lr_lambda(captured["cfg"])(6) < 0.2  # over --steps
    _run(tmp_path / "b", _cfg(tmp_path / "b", schedule_steps=5), jobs=["j1"])
    assert captured["cfg"].schedule_steps == 5


def test_unknown_job_sizes_leave_the_schedule_constant_and_say_so(captured, tmp_path, caplog):
    _run(tmp_path, _cfg(tmp_path), jobs=["nope"])
    assert captured["cfg"].schedule_steps is None
    assert "constant" in caplog.text
