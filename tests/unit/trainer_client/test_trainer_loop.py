"""The Eagle-3 trainer's loop without a sidecar: learning, checkpoint format, deferred acks, resume.

Hidden states are real (plain transformers on the tiny verifier); only the stream is replaced
by a list that records acknowledgements, so these run in seconds. The same behaviour through
the real stack and a SIGKILL is in tests/integration/trainer_client/test_trainer_e2e.py.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from connector import protocol as P
from hsstream.tiny_model import hf_hidden_states
from trainer_client.eagle3 import Eagle3OnlineTrainer, MissingLayersError, TrainConfig, latest_checkpoint, latest_draft
from trainer_client.drafts import eagle3 as E3
from trainer_client.train import checkpoints as M
from trainer_client.train.trainer import KEYS_LOG
from trainer_client.stream import Sample

LAYERS = [2, 6, 9, 12]


class ListStream:
    """Stands in for HiddenStateStream: yields given samples, records what is acknowledged when."""

    def __init__(self, samples: list[Sample], on_ack=None) -> None:  # noqa: ANN001
        self.samples = samples
        self.used: list[P.SampleKey] = []
        self.acked: list[P.SampleKey] = []
        self.on_ack = on_ack

    def __iter__(self):
        for s in self.samples:
            self.used.append(s.key)
            yield s

    def keepalive(self) -> None:
        self.events = [*getattr(self, "events", []), "keepalive"]

    def ack_through(self, key: P.SampleKey) -> None:
        self.events = [*getattr(self, "events", []), "ack"]
        i = self.used.index(key)
        self.acked.extend(self.used[: i + 1])
        del self.used[: i + 1]
        if self.on_ack:
            self.on_ack(key)


@pytest.fixture(scope="module")
def samples(tiny_model) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i in range(24):
        ids = [rng.randrange(0, 64) for _ in range(rng.randint(20, 40))]
        hs = hf_hidden_states(tiny_model, ids, LAYERS).to(torch.bfloat16)
        out.append(Sample(P.SampleKey(job="unit", index=i), torch.tensor(ids), hs, LAYERS, 12, None))
    return out


def cfg(tiny_model, out, **kw) -> TrainConfig:
    base = dict(verifier=tiny_model, out_dir=str(out), draft_vocab_size=128, checkpoint_every=4, progress=False,
                tensorboard=False, lr=3e-3, warmup_steps=2, threads=1)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def counts_of(samples):
    c: dict[int, int] = {}
    for s in samples:
        for t in s.token_ids.tolist():
            c[t] = c.get(t, 0) + 1
    return c


def trained_keys(out) -> list[str]:
    return [k for line in (out / KEYS_LOG).read_text().splitlines() for k in json.loads(line)["keys"]]


def test_acks_only_after_a_checkpoint_that_includes_them(tiny_model, samples, tmp_path):
    out = tmp_path / "run"
    events = []

    def on_ack(key):
        ck = M.latest_checkpoint(out)
        events.append((str(key), ck.name, M.load_state(ck)["step"]))

    stream = ListStream(samples[:10], on_ack=on_ack)
    res = Eagle3OnlineTrainer(cfg(tiny_model, out), counts_of(samples)).train(stream)
    assert res.steps == 10 and res.samples == 10
    assert [str(k) for k in stream.acked] == [str(s.key) for s in samples[:10]]
    # acked through sample 4 right after step-4 was written, through 8 after step-8, the rest at the end
    assert events == [
        ("unit/0/3", "step-00000004", 4), ("unit/0/7", "step-00000008", 8), ("unit/0/9", "step-00000010", 10),
    ]  # fmt: skip
    assert [p.name for _, p in M.list_checkpoints(out)] == ["step-00000008", "step-00000010"]  # keeps 2
    # the leases are kept alive around each checkpoint write (before and after), then acked
    assert stream.events == ["keepalive", "keepalive", "ack"] * 3


def test_checkpoint_is_speculators_format_with_layer_ids_and_maps(tiny_model, samples, tmp_path):
    out = tmp_path / "run"
    res = Eagle3OnlineTrainer(cfg(tiny_model, out, max_steps=3), counts_of(samples)).train(ListStream(samples))
    assert res.steps == 3
    draft = latest_draft(out)
    assert draft is not None and str(draft) == res.draft_dir
    c = json.loads((draft / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3"
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 6, 9]
    assert c["draft_vocab_size"] == 128
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert {"fc.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"} <= keys
    assert "verifier_lm_head.weight" not in keys
    # the draft vocabulary is the 128 most frequent tokens of the counts given
    cnt = counts_of(samples)
    top = sorted(cnt, key=lambda t: (-cnt[t], t))[:128]
    assert sorted((torch.arange(128) + d2t).tolist()) == sorted(top) or len(cnt) < 128
    assert int(t2d.sum()) == 128
    # max_steps stops early: later samples were never trained nor acknowledged
    assert trained_keys(out) == [str(s.key) for s in samples[:3]]


def test_frozen_verifier_parts_stay_frozen_and_learning_happens(tiny_model, samples, tmp_path):
    out = tmp_path / "run"
    tr = Eagle3OnlineTrainer(cfg(tiny_model, out, checkpoint_every=100, lr=5e-3), counts_of(samples))
    res = tr.train(ListStream(samples + samples))  # 48 steps
    from safetensors.torch import load_file

    ref = load_file(f"{tiny_model}/model.safetensors")
    emb = tr.model.embed_tokens.weight
    assert not emb.requires_grad and not tr.model.verifier_lm_head.weight.requires_grad
    assert torch.equal(emb, ref["model.embed_tokens.weight"].float())
    assert torch.equal(tr.model.verifier_norm.weight, ref["model.norm.weight"].float())
    first = res.history[0]
    assert res.history[-1]["loss"] < 0.7 * first["loss"]
    assert res.top1[0] > first["top1_0"] + 0.1


def test_resume_continues_and_skips_what_the_weights_already_hold(tiny_model, samples, tmp_path):
    out = tmp_path / "run"
    counts = counts_of(samples)
    first = Eagle3OnlineTrainer(cfg(tiny_model, out, max_steps=6), counts)
    first.train(ListStream(samples[:8]))
    ck = latest_checkpoint(out)
    assert ck is not None and ck.name == "step-00000006"
    # what resume loads is exactly what the first run had trained
    fresh = E3.build_draft(tiny_model, [2, 6, 9], draft_vocab_size=128, t2d=first.model.t2d, d2t=first.model.d2t)
    E3.load_weights(fresh, ck)
    for k, v in first.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # Pretend the ack after step-6 never reached the sidecar: samples 4, 5 come back, then new ones.
    again = samples[4:6] + samples[6:12]
    second = Eagle3OnlineTrainer(cfg(tiny_model, out, max_steps=None), {})
    stream = ListStream(again)
    res = second.train(stream)
    assert second.resumed_from == ck
    # the weights it started from are the checkpoint's
    assert res.skipped_already_trained == 2
    assert res.steps == 6 + 6 and res.samples == 6
    keys = trained_keys(out)
    assert keys == [str(s.key) for s in samples[:6]] + [str(s.key) for s in samples[6:12]]
    assert len(keys) == len(set(keys))
    assert [str(k) for k in stream.acked] == [str(s.key) for s in again]  # the skipped ones acked too
    # started again after the jobs are complete: nothing to do, the newest checkpoint is the result
    again = Eagle3OnlineTrainer(cfg(tiny_model, out), {}).train(ListStream([]))
    assert again.steps == 12 and again.samples == 0 and again.draft_dir == str(latest_draft(out))
    # the newest checkpoint remembers only what it holds beyond the previous ack (4 and 5 are settled)
    assert M.load_state(latest_checkpoint(out))["unacked_keys"] == sorted(str(s.key) for s in samples[8:12])


def test_layers_checked_on_the_first_sample(tiny_model, samples, tmp_path):
    s = samples[0]
    no_n = Sample(s.key, s.token_ids, s.hidden_states[:, :3], [2, 6, 9], 12, None)
    stream = ListStream([no_n])
    with pytest.raises(MissingLayersError, match="not layer N=12"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "a"), counts_of(samples)).train(stream)
    assert latest_checkpoint(tmp_path / "a") is None and stream.acked == []
    # the default aux layers are Eagle-3's usual [2, N//2, N-3]; a stream with others is named
    other = Sample(s.key, s.token_ids, s.hidden_states, [3, 6, 9, 12], 12, None)
    with pytest.raises(MissingLayersError, match=r"not aux layer\(s\) \[2\]"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "b"), counts_of(samples)).train(ListStream([other]))
    with pytest.raises(MissingLayersError, match=r"not aux layer\(s\) \[3\]"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "c", aux_layer_ids=[3, 6, 9]), counts_of(samples)).train(
            ListStream([s])
        )


def test_empty_stream_is_an_error_not_a_silent_success(tiny_model, tmp_path):
    with pytest.raises(RuntimeError, match="before delivering any sample"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "r", draft_vocab_size=None), None).train(ListStream([]))


def test_eval_every_holds_out_measures_and_keeps_leases(tiny_model, samples, tmp_path):
    """--eval-every: the first K samples are held out (never trained, nor their repeats in the
    next epoch), evaluated every N steps and at the end with the current weights, logged with
    the other metrics; heartbeats go out around each evaluation and every sample is acked."""
    out = tmp_path / "run"
    again = [Sample(P.SampleKey(job="unit", index=s.key.index, epoch=1), s.token_ids, s.hidden_states, LAYERS, 12, None)
             for s in samples[:12]]  # fmt: skip
    stream = ListStream(samples[:12] + again)  # two epochs of 12: the second brings the held-out ones back
    tr = Eagle3OnlineTrainer(cfg(tiny_model, out, eval_every=5, eval_samples=3, checkpoint_every=100), counts_of(samples))
    res = tr.train(stream)
    held = {str(s.key) for s in samples[:3]}
    keys = trained_keys(out)
    assert res.held_out == 3 and tr.heldout_repeats == 3
    assert not held & set(keys) and "unit/1/0" not in keys and "unit/1/3" in keys
    assert res.steps == 24 - 6 and len(keys) == 18
    assert [str(k) for k in stream.acked] == [str(s.key) for s in samples[:12] + again]  # held out ones acked too
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "eval_top1_0" in x]
    assert [e["step"] for e in evals] == [5, 10, 15, 18]  # every 5 steps, and the final weights
    assert all(0.0 <= e[f"eval_top1_{i}"] <= 1.0 and e["eval_samples"] == 3 for e in evals for i in range(3))
    assert res.eval_top1 == [evals[-1][f"eval_top1_{i}"] for i in range(3)]
    # the figure is the final weights' (as saved) on exactly the held-out samples
    fresh = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "fresh", eval_every=1, eval_samples=3), counts_of(samples))
    fresh.prepare()
    E3.load_weights(fresh.model, latest_checkpoint(out))
    for s in samples[:3]:
        fresh._hold_out(s, str(s.key))
    again_eval = fresh.evaluate()
    assert [again_eval[f"eval_top1_{i}"] for i in range(3)] == pytest.approx(res.eval_top1)
    assert M.load_state(latest_checkpoint(out))["heldout_digests"] == sorted(tr.heldout_digests)
    # heartbeats before each held-out sample and after each evaluation (4 evaluations x (3 + 1)), and around the checkpoint
    assert stream.events.count("keepalive") == 4 * 4 + 2


def test_eval_ids_hold_out_the_same_samples_whatever_their_order(tiny_model, samples, tmp_path):
    """--eval-ids: the named samples are held out wherever they come in the stream (the online vs
    offline benchmark's arms get the same documents in different orders), their repeats too, even
    with other tokens (a regenerated reply under the same id); the rest is trained on."""
    import dataclasses

    ids = ("s2", "s7", "s11")
    labelled = [dataclasses.replace(s, label=f"s{s.key.index}") for s in samples[:12]]
    regen = dataclasses.replace(labelled[7], key=P.SampleKey(job="unit", index=7, epoch=1),
                                token_ids=labelled[7].token_ids.flip(0))  # same id, other tokens
    runs = {}
    for name, order in (("forward", labelled + [regen]), ("reverse", labelled[::-1] + [regen])):
        out = tmp_path / name
        tr = Eagle3OnlineTrainer(cfg(tiny_model, out, eval_every=50, eval_ids=ids, checkpoint_every=100),
                                 counts_of(samples))  # fmt: skip
        res = tr.train(ListStream(list(order)))
        runs[name] = (res, tr, set(trained_keys(out)))
    for res, tr, keys in runs.values():
        assert tr.heldout_ids == set(ids) and res.held_out == 3 and tr.heldout_repeats == 1
        assert keys == {f"unit/0/{i}" for i in range(12)} - {"unit/0/2", "unit/0/7", "unit/0/11"}
    assert runs["forward"][1].heldout_digests == runs["reverse"][1].heldout_digests  # the same samples
    assert M.load_state(latest_checkpoint(tmp_path / "forward"))["heldout_ids"] == sorted(ids)


def test_eval_fraction_holds_out_what_the_shared_rule_picks_in_every_epoch(tiny_model, samples, tmp_path):
    """--eval-fraction: exactly the samples connector/contract/holdout.py picks (by id, else index,
    and --eval-seed) are never trained, in any order and epoch, also with other tokens (a
    regenerated reply); the first --eval-samples of them are evaluated in-run."""
    import dataclasses

    from connector.contract.holdout import held_out, sample_identity

    frac, seed = 0.3, 5
    base = samples[:12]
    labelled = [dataclasses.replace(s, label=f"row-{s.key.index}") if s.key.index % 2 else s for s in base]
    epoch1 = [dataclasses.replace(s, key=P.SampleKey(job="unit", index=s.key.index, epoch=1),
                                  token_ids=s.token_ids.flip(0)) for s in labelled]  # fmt: skip
    picked = {s.key.index for s in labelled if held_out(sample_identity(s.label, s.key.index), frac, seed)}
    assert 0 < len(picked) < 12, picked  # the seed was chosen so that the test tells something
    out = tmp_path / "frac"
    tr = Eagle3OnlineTrainer(cfg(tiny_model, out, eval_every=50, eval_samples=2, eval_fraction=frac, eval_seed=seed,
                                 checkpoint_every=100), counts_of(samples))  # fmt: skip
    res = tr.train(ListStream(labelled[::-1] + epoch1))
    trained = set(trained_keys(out))
    assert trained == {f"unit/{e}/{i}" for e in (0, 1) for i in range(12) if i not in picked}
    assert res.held_out_by_fraction == 2 * len(picked) and res.held_out == min(2, len(picked))
    other = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "other", eval_fraction=frac, eval_seed=seed + 1,
                                    checkpoint_every=100), counts_of(samples))  # fmt: skip
    other.train(ListStream(labelled))
    assert set(trained_keys(tmp_path / "other")) != {f"unit/0/{i}" for i in range(12) if i not in picked}
    with pytest.raises(ValueError, match="not both"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "x", eval_fraction=0.1, eval_ids=("a",)), None)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "y", eval_fraction=1.0), None)


def test_eval_settings_are_checked(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="--eval-every must be >= 0"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "a", eval_every=-1), None)
    with pytest.raises(ValueError, match="--eval-samples >= 1"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "b", eval_every=5, eval_samples=0), None)
    with pytest.raises(ValueError, match="--checkpoint-every-s must be > 0"):
        Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "c", checkpoint_every_s=0), None)


def test_checkpoint_every_s_checkpoints_on_the_wall_clock(tiny_model, samples, tmp_path, monkeypatch):
    """Checkpoints at each multiple of S seconds after the clock origin (runs compared at equal wall-clock)."""
    import trainer_client.train.trainer as T

    now = [1000.0]
    monkeypatch.setattr(T.time, "time", lambda: now[0])

    class Ticking(ListStream):
        def __iter__(self):
            for s in super().__iter__():
                now[0] += 4.0  # each sample arrives 4 s after the previous one
                yield s

    out = tmp_path / "run"
    c = cfg(tiny_model, out, checkpoint_every=100, checkpoint_every_s=10.0, clock_origin=1000.0, keep_checkpoints=0)
    Eagle3OnlineTrainer(c, counts_of(samples)).train(Ticking(samples[:8]))
    # steps at t = 4, 8, 12, ... 32: the first step past 10, 20, 30 s checkpoints, then the end (step 8)
    assert [p.name for _, p in M.list_checkpoints(out)] == ["step-00000003", "step-00000005", "step-00000008"]
