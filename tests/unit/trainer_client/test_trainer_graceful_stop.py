"""A stop asked for (SIGTERM, Ctrl-C) saves every step trained (``trainer_client/train/stop.py``);
what a stop that does not wait says: test_trainer_stop.py.

Before, the stop raised wherever it landed and a run kept only its newest periodic checkpoint (an
H100 run cut at its deadline trained 2,728 steps and kept step 2,396). Real signals, sent to this
process, with the handler ``hsstream train`` installs (a stop is ``SystemExit(0)``)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.unit.trainer_client.test_trainer_loop import ListStream, cfg, counts_of, samples  # noqa: F401 - fixture
from trainer_client.eagle3 import Eagle3OnlineTrainer
from trainer_client.train import checkpoints as M
from trainer_client.train.stop import GracefulStop


@pytest.fixture
def exit_0_on_stop():
    """As ``hsstream train`` does first (``hsstream.launch.exit_0_on_stop``), put back after."""
    prev = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def stop(_sig, _frame):
        raise SystemExit(0)

    for s in prev:
        signal.signal(s, stop)
    yield
    for s, h in prev.items():
        signal.signal(s, h)


class SignalledStream(ListStream):
    """Sends ``sig`` to this process when the loop asks for sample ``at`` (while it waits for data)."""

    def __init__(self, samples, at: int, sig: int = signal.SIGTERM) -> None:  # noqa: ANN001
        super().__init__(samples)
        self.at, self.sig = at, sig

    def __iter__(self):
        for i, s in enumerate(self.samples):
            if i == self.at:
                os.kill(os.getpid(), self.sig)
            self.used.append(s.key)
            yield s


def assert_saved_and_acked_through(tr, stream, out, samples, n: int) -> None:  # noqa: ANN001
    """Every step trained is saved (the newest checkpoint is step ``n``, the last trained) and
    acknowledged, no more: the first ``n`` samples, in order."""
    assert tr.step == n and M.list_checkpoints(out)[-1][0] == n
    assert [str(k) for k in stream.acked] == [str(s.key) for s in samples[:n]]


def trainer_signalled_in_step(tiny_model, samples, tmp_path, step: int) -> Eagle3OnlineTrainer:  # noqa: ANN001
    """A trainer that gets SIGTERM inside its step ``step`` (after the device work, before the loop
    sees it): the signal lands where nothing may be raised."""
    tr = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "r", checkpoint_every=100), counts_of(samples))
    tr.prepare()
    finish = tr.stepper.finish

    def finish_then_signal(h):  # noqa: ANN001
        out = finish(h)
        if tr.stepper.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    tr.stepper.finish = finish_then_signal
    return tr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_waiting_for_data_saves_every_step_and_acks_them(tiny_model, samples, tmp_path, exit_0_on_stop,
                                                                       sig):  # noqa: F811
    stream = SignalledStream(samples[:12], at=7, sig=sig)
    tr = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "r", checkpoint_every=100), counts_of(samples))
    with pytest.raises(SystemExit) as e:
        tr.train(stream)
    assert e.value.code == 0
    assert_saved_and_acked_through(tr, stream, tmp_path / "r", samples, 7)
    assert "stopped at step 7" in tr.stop_report[0] and "(step 7)" in tr.stop_report[0]
    assert signal.getsignal(sig) is not signal.default_int_handler  # the handlers were put back (exit_0_on_stop's)
    assert not isinstance(signal.getsignal(sig), type(GracefulStop()._ask))


def test_a_stop_during_a_step_lets_the_step_end_then_saves_it(tiny_model, samples, tmp_path, exit_0_on_stop):  # noqa: F811
    tr = trainer_signalled_in_step(tiny_model, samples, tmp_path, 3)
    stream = ListStream(samples[:12])
    with pytest.raises(SystemExit):
        tr.train(stream)
    assert_saved_and_acked_through(tr, stream, tmp_path / "r", samples, 3)


def test_a_second_signal_does_not_wait(exit_0_on_stop):
    stop = GracefulStop().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the first only asks
        assert stop.asked == signal.SIGTERM
        with pytest.raises(SystemExit):
            os.kill(os.getpid(), signal.SIGTERM)  # the second: the handler before, at once
    finally:
        stop.close()


def test_an_ignored_signal_stays_ignored(exit_0_on_stop):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop = GracefulStop().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.asked is None
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_a_stream_that_yields_when_idle_is_never_interrupted(tiny_model, samples, tmp_path, exit_0_on_stop):  # noqa: F811
    """``hsstream train``'s stream yields ``None`` every ``idle_s`` when quiet: the stop is a flag the
    loop reads at its next turn, so no exception is ever raised into the stream (it could land
    between the frames of a message the stream sends)."""

    class Quiet(ListStream):
        idle_s = 0.01
        after_signal: list[str] = []

        def __iter__(self):
            for s in self.samples:
                self.used.append(s.key)
                yield s
            os.kill(os.getpid(), signal.SIGTERM)  # while it is quiet: nothing more will come
            self.after_signal.append("resumed")  # an exception raised into the stream would skip this
            while True:
                yield None

    stream = Quiet(samples[:5])
    tr = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "r", checkpoint_every=100), counts_of(samples))
    tr.drained = lambda pending: False  # the sidecar still has work: only the stop ends this run
    with pytest.raises(SystemExit):
        tr.train(stream)
    assert stream.after_signal == ["resumed"]
    assert_saved_and_acked_through(tr, stream, tmp_path / "r", samples, 5)


def test_a_stop_asked_as_the_run_ends_is_not_swallowed(tiny_model, samples, tmp_path, exit_0_on_stop):  # noqa: F811
    """The signal lands in the last step and the stream then ends: the run ends as it would (its
    final checkpoint), and the stop still goes on after it — a caller's Ctrl-C is never lost."""

    class Ending(ListStream):
        idle_s = 0.01

    tr = trainer_signalled_in_step(tiny_model, samples, tmp_path, 5)
    stream = Ending(samples[:5])
    with pytest.raises(SystemExit):
        tr.train(stream)
    assert_saved_and_acked_through(tr, stream, tmp_path / "r", samples, 5)
