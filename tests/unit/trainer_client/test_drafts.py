"""The draft plug-ins beside Eagle-3 (P-EAGLE, DFlash, DSpark) on the generic trainer, without a sidecar.

Hidden states are real (plain transformers on the tiny verifier), the stream a list that
records acknowledgements. Checked: each draft learns, its checkpoint is speculators' format
with what vLLM's speculators loader reads for that method, a resumed run loads it, and what a
draft lacks (a layer, a tensor, the mask token) stops the run naming the draft and the need.
That vLLM serves these checkpoints is tests/integration/trainer_client/test_trainer_e2e.py's; DSpark,
which vLLM serves on a GPU only, is checked against vLLM's own config parsing as far as it goes on CPU.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from connector import protocol as P
from hsstream.tiny_model import hf_hidden_states
from trainer_client import drafts as D
from trainer_client.drafts.base import DraftConfigError, MissingLayersError
from trainer_client.drafts import dspark as DS
from trainer_client.drafts.dflash import vllm_target_layer_ids
from trainer_client.stream import Sample
from trainer_client.train import checkpoints as M
from tests.unit.trainer_client.test_trainer_loop import ListStream, counts_of
from trainer_client.train.trainer import OnlineTrainer, TrainConfig

LAYERS = [2, 6, 9, 12]
MASK = 1  # the tiny verifier's tokenizer declares no mask token: the tests choose one


@pytest.fixture(scope="module")
def samples(tiny_model) -> list[Sample]:
    rng = random.Random(0)
    base = []
    for i in range(6):
        ids = [rng.randrange(0, 64) for _ in range(rng.randint(24, 40))]
        hs = hf_hidden_states(tiny_model, ids, LAYERS).to(torch.bfloat16)
        base.append((torch.tensor(ids), hs))
    return [Sample(P.SampleKey(job="unit", index=i), *base[i % 6], LAYERS, 12, None) for i in range(36)]


def cfg(tiny_model, out, **kw) -> TrainConfig:
    """The run's settings; the drafts' own (mask_token_id, block_size, ...) go into draft_options."""
    base = dict(verifier=tiny_model, out_dir=str(out), draft_vocab_size=128, checkpoint_every=12, progress=False,
                tensorboard=False, lr=3e-3, warmup_steps=2, threads=1, mask_token_id=MASK, schedule="constant")  # fmt: skip
    base.update(kw)
    opts = {k: base.pop(k) for k in list(base) if k in D.option_table()}
    return TrainConfig(**base, draft_options=opts)


def test_the_registry_names_every_draft_and_refuses_others():
    assert D.names() == ["dflash", "dspark", "eagle3", "peagle"]
    with pytest.raises(D.UnknownDraftError, match="unknown draft 'medusa': use one of dflash, dspark, eagle3, peagle"):
        D.get("medusa")


@pytest.mark.parametrize("draft", ["dflash", "dspark", "peagle"])
def test_a_parallel_draft_learns_and_saves_what_vllm_serves(tiny_model, samples, tmp_path, draft):
    out = tmp_path / draft
    stream = ListStream(samples)
    res = OnlineTrainer(cfg(tiny_model, out, draft=draft), counts_of(samples)).train(stream)
    k = {"dflash": 3, "dspark": 4, "peagle": 4}[draft]  # block_size 4 → 3 drafted (DSpark: 4, the anchor too); num_depths 4
    assert res.steps == len(samples) and len(res.top1) == k and res.draft == draft
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-6:]) / 6 < 0.8 * sum(losses[:6]) / 6, losses
    assert sorted(map(str, stream.acked)) == sorted(str(s.key) for s in samples)
    conf = json.loads((out / "final" / "config.json").read_text())
    assert conf["speculators_model_type"] == draft and conf["mask_token_id"] == MASK
    if draft == "dflash":
        # what vLLM's update_dflash reads: our layer ids as they are; its target_layer_ids are one less
        assert conf["aux_hidden_state_layer_ids"] == LAYERS[:3] and conf["block_size"] == 4
        assert vllm_target_layer_ids(conf["aux_hidden_state_layer_ids"]) == [1, 5, 8]
        assert res.speculative_config["method"] == "dflash" and res.speculative_config["num_speculative_tokens"] == 3
    elif draft == "dspark":
        assert conf["aux_hidden_state_layer_ids"] == LAYERS[:3] and conf["block_size"] == 4
        assert conf["sample_from_anchor"] is True and conf["markov_rank"] == 256 and conf["markov_head_type"] == "vanilla"
        assert res.speculative_config == {"method": "dspark", "model": str((out / "final").resolve()),
                                          "num_speculative_tokens": 4}  # fmt: skip
    else:
        assert conf["eagle_aux_hidden_state_layer_ids"] == LAYERS[:3]
        assert res.speculative_config == {"method": "eagle3", "model": str((out / "final").resolve()),
                                          "num_speculative_tokens": 4, "parallel_drafting": True}  # fmt: skip
    assert '"method": "' in res.serve and str((out / "final").resolve()) in res.serve
    # a resumed run rebuilds the same draft and loads exactly these weights
    again = OnlineTrainer(cfg(tiny_model, out, draft=draft), {})
    again.prepare()
    first = torch.load(M.latest_checkpoint(out) / M.STATE_FILE, weights_only=True)
    assert first["draft"] == draft and again.step == res.steps
    from safetensors.torch import load_file

    saved = load_file(str(out / "final" / "model.safetensors"))
    sd = again.model.state_dict()
    for name, t in saved.items():
        assert torch.equal(sd[name].to(t.dtype), t), name


def test_vllm_target_layer_ids_match_vllms_own_speculators_loader():
    """Our ids into the checkpoint; vLLM's loader turns them into its DFlash target_layer_ids."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.algos import update_dflash

    pre: dict = {}
    update_dflash({"aux_hidden_state_layer_ids": [2, 6, 9], "mask_token_id": MASK, "draft_vocab_size": 128}, pre)
    assert pre["eagle_aux_hidden_state_layer_ids"] == [2, 6, 9]  # what the verifier captures: our ids
    assert pre["dflash_config"]["target_layer_ids"] == vllm_target_layer_ids([2, 6, 9])


def test_dspark_checkpoint_reloads_in_speculators_and_passes_vllms_own_parsing(tiny_model, samples, tmp_path):
    """The saved DSpark draft: speculators' from_pretrained gives back exactly its weights; vLLM's
    speculators loader (update_dspark) reads what its DSpark runtime needs; vLLM's engine config
    accepts the draft up to the model runner, where the CPU build's V1 runner refuses it with the
    words hsstream eval quotes (DSpark's plug-in, V1_REFUSAL)."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file
    from speculators.models.dspark import DSparkDraftModel

    out = tmp_path / "ds"
    res = OnlineTrainer(cfg(tiny_model, out, draft="dspark", max_steps=3, markov_rank=16),
                        counts_of(samples)).train(ListStream(samples[:3]))  # fmt: skip
    final = out / "final"
    saved = load_file(str(final / "model.safetensors"))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight", "d2t"} <= set(saved)  # fmt: skip
    back = DSparkDraftModel.from_pretrained(str(final)).state_dict()
    for name, t in saved.items():
        assert torch.equal(back[name].to(t.dtype), t), name
    assert back["markov_head.markov_w1.weight"].shape == (512, 16)  # verifier vocabulary x rank

    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    conf = json.loads((final / "config.json").read_text())
    assert SpeculatorsConfig.extract_vllm_speculative_config(conf) == {"method": "dspark", "num_speculative_tokens": 4}
    v = SpeculatorsConfig.from_pretrained(str(final))
    assert v.architectures == ["Qwen3DSparkModel"]
    assert v.eagle_aux_hidden_state_layer_ids == LAYERS[:3]  # what the verifier captures: our ids
    assert v.target_layer_ids == DS.vllm_target_layer_ids(LAYERS[:3]) == [1, 5, 8]
    assert (v.sample_from_anchor, v.dspark_bonus_anchor, v.block_size, v.mask_token_id, v.markov_rank) == \
        (True, False, 4, MASK, 16)  # fmt: skip
    assert (v.enable_confidence_head, v.confidence_head_with_markov, v.draft_vocab_size) == (True, True, 128)

    from vllm.engine.arg_utils import EngineArgs

    spec = res.speculative_config
    assert spec == {"method": "dspark", "model": str(final.resolve()), "num_speculative_tokens": 4}
    with pytest.raises(Exception, match=re.escape(DS.V1_REFUSAL)):
        EngineArgs(model=tiny_model, speculative_config=spec, max_model_len=256).create_engine_config()


def test_a_speculators_mtp_draft_has_no_serving_path_in_this_vllm():
    """Why there is no MTP plug-in (docs/trainer.md, "Drafts"): vLLM's speculators loader knows no
    ``mtp`` checkpoint, so a speculators MTP draft dir is refused before any engine starts (vLLM's
    ``mtp`` method runs a verifier's own built-in MTP layers instead). Fails once vLLM adds one."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    assert "dspark" in SUPPORTED_SPECULATORS_TYPES and "mtp" not in SUPPORTED_SPECULATORS_TYPES
    with pytest.raises(ValueError, match="Expected one of"):
        SpeculatorsConfig.extract_transformers_pre_trained_config({"speculators_model_type": "mtp"})


def test_dspark_settings_that_cannot_work_are_refused_naming_the_draft(tiny_model, tmp_path):
    with pytest.raises(DraftConfigError, match=r"^DSpark: markov_rank 0: vLLM's DSpark always has the Markov head"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "a", draft="dspark", markov_rank=0), None)
    with pytest.raises(DraftConfigError, match=r"^DSpark: block_size 1"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "b", draft="dspark", block_size=1), None)
    with pytest.raises(DraftConfigError, match=r"^DSpark: draft_attn_impl 'flash'"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "c", draft="dspark", draft_attn_impl="flash"), None)


@pytest.mark.parametrize("draft", ["dflash", "dspark", "peagle"])
def test_no_mask_token_stops_the_run_naming_the_draft(tiny_model, samples, tmp_path, draft):
    label = {"dflash": "DFlash", "dspark": "DSpark", "peagle": "P-EAGLE"}[draft]
    with pytest.raises(DraftConfigError, match=rf"^{label} needs a mask token.*--mask-token-id"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "m", draft=draft, mask_token_id=None), None)
    with pytest.raises(DraftConfigError, match=rf"^{label}: --mask-token-id 4096 is outside"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "n", draft=draft, mask_token_id=4096), None)
    # the pad token's row is zero (nn.Embedding's padding_idx): every drafted position would be blind
    with pytest.raises(DraftConfigError, match=rf"^{label}: mask token 509's embedding row in the verifier is all zeros"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "z", draft=draft, mask_token_id=509), counts_of(samples)).prepare()


@pytest.mark.parametrize("draft", ["eagle3", "dflash", "dspark", "peagle"])
def test_a_missing_layer_or_tensor_names_the_draft_and_what_it_needs(tiny_model, samples, tmp_path, draft):
    s = samples[0]
    no_n = Sample(s.key, s.token_ids, s.hidden_states[:, :3], LAYERS[:3], 12, None)
    name = {"eagle3": "Eagle-3", "dflash": "DFlash", "dspark": "DSpark", "peagle": "P-EAGLE"}[draft]
    with pytest.raises(MissingLayersError, match=rf"^{name}: the stream carries layers \[2, 6, 9\] but not layer N=12"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "a", draft=draft), counts_of(samples)).train(ListStream([no_n]))
    with pytest.raises(MissingLayersError, match=rf"^{name}: the stream carries layers .* not aux layer\(s\) \[3\]"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "b", draft=draft, aux_layer_ids=[3, 6, 9]),
                      counts_of(samples)).train(ListStream([s]))  # fmt: skip
    flat = Sample(s.key, s.token_ids, s.hidden_states[:, 0], LAYERS, 12, None)  # [T, H]: no layer axis
    with pytest.raises(MissingLayersError, match=rf"^{name}: sample .* lacks token ids or \[tokens, layers, hidden\]"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "c", draft=draft), counts_of(samples)).train(ListStream([flat]))
    dup = Sample(s.key, s.token_ids, s.hidden_states, [2, 6, 6, 12], 12, None)  # the layer ids out of step with the slices
    with pytest.raises(MissingLayersError, match=rf"^{name}: sample .* names layers \[2, 6, 6, 12\] for 4 hidden-state"):
        OnlineTrainer(cfg(tiny_model, tmp_path / "d", draft=draft), counts_of(samples)).train(ListStream([dup]))


def test_a_wrong_layer_order_is_read_in_ascending_order_for_every_draft(tiny_model, samples):
    """vLLM hands the aux states to a draft in ascending layer order whatever its config's order:
    a stream in another order is read by layer id, never by position."""
    s = samples[0]
    perm = [3, 1, 0, 2]  # layers 12, 6, 2, 9
    shuffled = Sample(s.key, s.token_ids, s.hidden_states[:, perm], [LAYERS[i] for i in perm], 12, None)
    from trainer_client.train.checkpoints import verifier_text_config

    for name in D.names():
        d = D.get(name)(TrainConfig(verifier=tiny_model, out_dir="/nonexistent", draft_options={"mask_token_id": MASK}),
                        verifier_text_config(tiny_model))  # fmt: skip
        a, b = d.features(s, [2, 6, 9]), d.features(shuffled, [2, 6, 9])
        assert torch.equal(a.aux, b.aux) and torch.equal(a.last, b.last), name


def test_resuming_a_run_with_another_draft_is_refused(tiny_model, samples, tmp_path):
    out = tmp_path / "r"
    OnlineTrainer(cfg(tiny_model, out, draft="dflash", max_steps=2), counts_of(samples)).train(ListStream(samples[:2]))
    with pytest.raises(ValueError, match="holds a dflash run, not peagle"):
        OnlineTrainer(cfg(tiny_model, out, draft="peagle"), {}).prepare()


@pytest.mark.parametrize("draft", ["eagle3", "dflash", "dspark", "peagle"])
def test_every_draft_trains_unchanged_on_samples_read_in_place_from_arena_slots(tiny_model, samples, tmp_path, draft):
    """Issue 40: the stream yields an arena slot's tensors as views of the trainer's copy-on-write
    mapping. Each draft (with the data path's prefetch: the device copy's path) trains on them
    exactly as on private copies of the same samples, and leaves the shared slots as written."""
    import dataclasses

    from connector.contract import arena as A
    from connector.contract import sample_file as SF
    from tests.support import sample_files as SFX
    from trainer_client.sample_checks import load_and_check
    from connector import layouts as L

    picks = samples[:2]
    longest = max(s.token_ids.numel() for s in picks)
    length = SFX.slot_bytes(longest, len(LAYERS), picks[0].hidden_states.shape[-1])
    with SFX.shm_spool() as spool:
        arena = SFX.make_arena(spool, A.PAGE + len(picks) * length)
        maps, written, views = L.Readers(spool), [], []
        for i, s in enumerate(picks):
            slot = SFX.slot_for(arena, A.PAGE + i * length, length, generation=i + 1)
            written.append(SFX.write_sample(spool, key=s.key, slot=slot, hidden_states=s.hidden_states,
                                            token_ids=s.token_ids, layer_ids=LAYERS, num_hidden_layers=12))  # fmt: skip
            views.append(load_and_check(spool, written[-1].deliver, readers=maps))
        copies = [dataclasses.replace(x, hidden_states=x.hidden_states.clone(), token_ids=x.token_ids.clone())
                  for x in views]  # fmt: skip
        runs = []
        for name, got in (("views", views), ("copies", copies)):
            torch.manual_seed(0)  # P-EAGLE draws its anchors from the global generator
            res = OnlineTrainer(cfg(tiny_model, tmp_path / name, draft=draft, prefetch=1, checkpoint_every=100),
                                counts_of(got)).train(ListStream(got))  # fmt: skip
            runs.append([(h["loss"], h["grad_norm"]) for h in res.history])
        assert runs[0] == runs[1] and len(runs[0]) == len(picks)
        for w in written:
            assert torch.equal(SFX.read_slot_tensors(spool, w.notice.slot)[SF.HIDDEN_STATES_KEY], w.hidden_states)
        del views, copies
