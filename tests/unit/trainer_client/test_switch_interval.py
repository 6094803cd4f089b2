"""Python's switch interval is lowered (never raised) where a latency-bound thread shares the
interpreter with busy ones: the sidecar, and a stream with check workers."""

from __future__ import annotations

import sys

import pytest

from connector.contract.settings import Settings, lower_switch_interval
from trainer_client import HiddenStateStream


@pytest.fixture(autouse=True)
def restore():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_lowered_to_the_setting_never_raised_and_zero_leaves_it():
    lower_switch_interval(1.0)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    lower_switch_interval(3.0)  # higher than now: left alone
    assert sys.getswitchinterval() == pytest.approx(0.001)
    sys.setswitchinterval(0.005)
    lower_switch_interval(0)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert Settings().switch_interval_ms == 1.0


@pytest.mark.parametrize(("workers", "env", "want"), [(4, None, 0.001), (0, None, 0.005), (4, "0", 0.005),
                                                     (4, "0.5", 0.0005)])  # fmt: skip
def test_a_stream_with_workers_lowers_it(tmp_path, monkeypatch, workers, env, want):
    if env is not None:
        monkeypatch.setenv("HSSTREAM_SWITCH_INTERVAL_MS", env)
    s = HiddenStateStream(f"ipc://{tmp_path}/d.sock", spool_dir=tmp_path, workers=workers)
    s.close()
    assert sys.getswitchinterval() == pytest.approx(want)


def test_the_sidecar_lowers_it_when_it_starts(tmp_path):
    from fastapi.testclient import TestClient

    from server.app import create_app

    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9")
    with TestClient(create_app(s)):  # the lifespan runs: threads start, then stop
        assert sys.getswitchinterval() == pytest.approx(0.001)


@pytest.mark.parametrize("bad", ["0.001", "-1", "5000"])
def test_a_switch_interval_that_would_thrash_or_stall_is_refused_naming_the_range(monkeypatch, bad):
    from pydantic import ValidationError

    monkeypatch.setenv("HSSTREAM_SWITCH_INTERVAL_MS", bad)
    with pytest.raises(ValidationError, match=r"switch_interval_ms[\s\S]*must be 0 \(leave Python's\) or between 0.05 and 1000 ms"):
        Settings()


def test_a_bad_read_thread_count_names_the_variable():
    from trainer_client.sample_reader import _read_threads

    assert _read_threads(None) == min(8, __import__("os").cpu_count())
    assert _read_threads("1") == 1
    for bad in ("zero", "0", "-2", "1.5"):
        with pytest.raises(ValueError, match=f"HSSTREAM_READ_THREADS must be a positive integer .*got '{bad}'"):
            _read_threads(bad)
