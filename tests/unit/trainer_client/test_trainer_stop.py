"""What a stopped run says (issue 39 item 2: Ctrl-C in ``hsstream train`` said nothing), and a
sample with nothing to learn never makes a step of loss 0. Real hidden states of the tiny
verifier, the stream replaced by a list (``test_trainer_loop.ListStream``)."""

from __future__ import annotations

import logging

import pytest
import torch

from connector import protocol as P
from hsstream.tiny_model import hf_hidden_states
from tests.unit.trainer_client.test_trainer_loop import LAYERS, ListStream, cfg, counts_of
from trainer_client.eagle3 import Eagle3OnlineTrainer
from trainer_client.stream import Sample
from trainer_client.train import checkpoints as M


@pytest.fixture(scope="module")
def samples(tiny_model) -> list[Sample]:
    out = []
    for i in range(6):
        ids = [(7 * i + 3 * k) % 64 for k in range(12)]
        hs = hf_hidden_states(tiny_model, ids, LAYERS).to(torch.bfloat16)
        out.append(Sample(P.SampleKey(job="j", index=i), torch.tensor(ids), hs, LAYERS, 12, None))
    return out


class Interrupted(ListStream):
    """Yields ``n`` samples, then a ``KeyboardInterrupt`` is raised where the loop waits for the next
    (as a second Ctrl-C does, or one where the trainer installed no handler: not the main thread;
    a first signal is a stop at a step boundary with a checkpoint, test_trainer_graceful_stop.py);
    says how many leases it holds as HiddenStateStream does."""

    def __init__(self, samples, n, unacked=None, lease_s=None):  # noqa: ANN001
        super().__init__(samples)
        self.n, self.lease_s = n, lease_s
        if unacked is not None:
            self.unacked = unacked

    def __iter__(self):
        for k, s in enumerate(super().__iter__()):
            if k == self.n:
                raise KeyboardInterrupt
            yield s


def test_ctrl_c_says_which_checkpoint_is_saved_and_what_comes_back(tiny_model, samples, tmp_path, caplog):
    out = tmp_path / "run"
    tr = Eagle3OnlineTrainer(cfg(tiny_model, out, checkpoint_every=2), counts_of(samples))
    stream = Interrupted(samples, 5, unacked=3, lease_s=120.0)
    with caplog.at_level(logging.WARNING, logger="hsstream.train"), pytest.raises(KeyboardInterrupt):
        tr.train(stream)
    ck = M.latest_checkpoint(out)
    assert ck.name == "step-00000004"
    first, second = tr.stop_report
    assert first == (f"stopped at step 5: saved {ck} (step 4); a run with the same out dir ({out}) resumes from it, "
                     "on the same jobs")  # fmt: skip
    assert second == ("3 sample(s) delivered since then are not acknowledged, and the 1 step(s) trained since are not "
                      "saved: the sidecar hands them out again after 120 s without word from this trainer (its lease); "
                      "the jobs stay open on the sidecar until every sample is acknowledged")  # fmt: skip
    assert first in caplog.text and second in caplog.text
    assert [str(k) for k in stream.acked] == [str(s.key) for s in samples[:4]]  # acks only through the checkpoint
    # resumed: the report counts from the checkpoint it resumed from, and the stream's own count
    tr2 = Eagle3OnlineTrainer(cfg(tiny_model, out, checkpoint_every=100), counts_of(samples))
    with pytest.raises(KeyboardInterrupt):
        tr2.train(Interrupted(samples[4:], 1))
    assert tr2.stop_report[0].startswith(f"stopped at step 5: saved {ck} (step 4)")
    assert tr2.stop_report[1].startswith("1 sample(s) delivered since then are not acknowledged")


def test_a_stop_before_the_first_checkpoint_says_nothing_is_saved(tiny_model, samples, tmp_path):
    tr = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "run", checkpoint_every=100), counts_of(samples))
    with pytest.raises(KeyboardInterrupt):
        tr.train(Interrupted(samples, 2))
    assert tr.stop_report[0].startswith("stopped at step 2, before the first checkpoint: nothing saved")
    assert tr.stop_report[1].startswith("2 sample(s) delivered to this run are not acknowledged: the sidecar hands "
                                        "them out again once this trainer's lease lapses")  # fmt: skip


def test_a_sample_with_no_trained_position_is_acknowledged_without_a_step(tiny_model, samples, tmp_path):
    def masked(s: Sample, mask: list[int]) -> Sample:
        return Sample(s.key, s.token_ids, s.hidden_states, s.layer_ids, s.num_hidden_layers, torch.tensor(mask))

    n = len(samples[0].token_ids)
    batch = [masked(samples[0], [1] + [0] * (n - 1)),  # only position 0: never a target (the draft predicts t+1)
             masked(samples[1], [0] * (n - 2) + [1, 1]), masked(samples[2], [0] * n), samples[3]]
    stream = ListStream(batch)
    res = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "run"), counts_of(samples)).train(stream)
    assert res.steps == 2 and res.samples == 2 and res.skipped_no_loss == 2
    assert all(h["loss"] > 0 for h in res.history)
    assert [str(k) for k in stream.acked] == [str(s.key) for s in batch]  # settled: acknowledged, never lost
