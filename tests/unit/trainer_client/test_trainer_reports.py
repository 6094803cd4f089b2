"""The generic trainer loop reports each step's figures to its stream (``HiddenStateStream.report``,
carried by the heartbeats to the sidecar's ``/metrics``) without user code; a loss the wire
refuses goes as none. The loop on real hidden states of the tiny verifier, the stream a list."""

from __future__ import annotations

import math

import pytest

from connector import protocol as P
from tests.unit.trainer_client.test_trainer_loop import ListStream, cfg, counts_of, samples  # noqa: F401 - fixture
from trainer_client.eagle3 import Eagle3OnlineTrainer
from trainer_client.stream import HiddenStateStream
from trainer_client.train.trainer import report_step


class ReportingStream(ListStream):
    def __init__(self, samples) -> None:  # noqa: ANN001
        super().__init__(samples)
        self.reports: list[dict] = []

    def report(self, **kw) -> None:  # noqa: ANN003
        P.TrainReport(**kw)  # what the real stream refuses, this one refuses too
        self.reports.append(kw)


def test_every_step_is_reported_with_its_loss_and_speed(tiny_model, samples, tmp_path):  # noqa: F811
    stream = ReportingStream(samples[:6])
    res = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "run"), counts_of(samples)).train(stream)
    assert res.steps == 6
    assert [r["step"] for r in stream.reports] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in stream.reports), stream.reports
    assert all(r["steps_per_s"] > 0 and r["samples_per_s"] > 0 for r in stream.reports), stream.reports


def test_a_loss_the_wire_refuses_goes_as_none_and_the_step_still_shows():
    s = HiddenStateStream("ipc:///nonexistent/d.sock", spool_dir="/dev/shm")
    try:
        report_step(s.report, {"step": 7, "loss": float("nan"), "samples_per_s": 8.0}, 1.5)
        assert s._heartbeat().train == P.TrainReport(step=7, loss=None, steps_per_s=1.5, samples_per_s=8.0)
        report_step(s.report, {"step": 8, "loss": 0.25, "samples_per_s": 8.0}, 1.5)
        assert s._heartbeat().train == P.TrainReport(step=8, loss=0.25, steps_per_s=1.5, samples_per_s=8.0)
        with pytest.raises(ValueError):  # a bad step is the loop's bug: it is not hidden
            report_step(s.report, {"step": -1, "loss": 0.25, "samples_per_s": 8.0}, 1.5)
    finally:
        s.close()
