"""hsstream/evaluate.py without an engine: our per-request figures against vLLM's own counting
(``SpecDecodingStats.observe_draft``, what its ``vllm:spec_decode_*`` counters add up), the
agreement check, the draft-dir check and the prompts file. The real engine:
tests/integration/hsstream/test_eval.py."""

from __future__ import annotations

import json
import random

import pytest

from hsstream import evaluate as E


def records(seed: int, k: int, n: int = 20) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        drafted = [rng.choice([k, k, k, 0, 1]) for _ in range(rng.randint(1, 30))]
        out.append({"per_step_drafted": drafted, "per_step_accepted": [rng.randint(0, d) for d in drafted]})
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_per_request_figures_count_as_vllms_stats(k):
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    recs = records(k, k)
    st = SpecDecodingStats.new(k)
    for r in recs:
        for a, d in zip(r["per_step_accepted"], r["per_step_drafted"]):
            if d:  # the scheduler makes stats only for steps that drafted (make_spec_decoding_stats)
                st.observe_draft(num_draft_tokens=d, num_accepted_tokens=a)
    ours = E.per_request_figures(recs + [None], k)
    assert ours == {"drafts": st.num_drafts, "drafted": st.num_draft_tokens, "accepted": st.num_accepted_tokens,
                    "accepted_per_position": st.num_accepted_tokens_per_pos}  # fmt: skip
    s = E.summarise(st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.num_accepted_tokens_per_pos)
    assert s["mean_acceptance_length"] == pytest.approx(1 + st.num_accepted_tokens / st.num_drafts)


def _res(ours: dict, vm: dict) -> dict:
    return {"temperatures": {"0.0": {"ours": ours, "vllm_metrics": vm}}}


def test_agreement_sees_swapped_positions_and_a_missing_side():
    f = E.per_request_figures(records(0, 3), 3)
    a = {**f, **E.summarise(f["drafts"], f["drafted"], f["accepted"], f["accepted_per_position"])}
    assert E.agreement(_res(a, dict(a))) == 0.0
    p = a["acceptance_per_position"]
    swapped = {**a, "acceptance_per_position": [p[2], p[1], p[0]]}
    assert E.agreement(_res(swapped, a)) == pytest.approx(p[0] - p[2]) and p[0] - p[2] > 0.02
    assert E.agreement(_res({**a, "acceptance_per_position": None}, a)) == float("inf")


def test_check_draft_dir_names_what_is_missing(tmp_path):
    with pytest.raises(E.DraftError, match="no such directory"):
        E.check_draft_dir(tmp_path / "nope")
    (tmp_path / "final").mkdir()
    with pytest.raises(E.DraftError, match="its draft is in final/"):
        E.check_draft_dir(tmp_path)
    d = tmp_path / "final"
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(E.DraftError, match="not a draft of a kind trained here"):
        E.check_draft_dir(d)
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    with pytest.raises(E.DraftError, match="no weights"):
        E.check_draft_dir(d)
    (d / "model.safetensors").write_bytes(b"")
    assert E.check_draft_dir(d) == d.resolve()


def test_a_dspark_draft_is_refused_on_the_cpu_build_naming_the_gpu_it_needs(tmp_path, monkeypatch):
    """vLLM serves DSpark with its V2 model runner only; this CPU build runs V1, which refuses it
    (tests/unit/trainer_client/test_drafts.py sees vLLM's own refusal say V1_REFUSAL's words)."""
    from typer.testing import CliRunner

    from hsstream.cli import app
    from trainer_client.drafts import dspark as DS

    d = tmp_path / "final"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "dspark", "block_size": 4, "sample_from_anchor": True}))
    (d / "model.safetensors").write_bytes(b"")
    assert not DS.v2_runner_available()  # the CPU build
    want = r"a dspark draft needs a GPU: vLLM 0\.32.*V2 model runner.*\"Model Runner V1 does not support: dspark speculative decoding\""
    with pytest.raises(E.DraftError, match=want):
        E.check_draft_dir(d)
    r = CliRunner().invoke(app, ["eval", "--draft", str(d), "--model", str(tmp_path)])
    assert r.exit_code == 2 and "needs a GPU" in r.output and "Traceback" not in r.output, r.output
    # where the V2 runner runs (a GPU host): served as method dspark, block_size tokens (the anchor drafts too)
    monkeypatch.setattr(DS, "v2_runner_available", lambda: True)
    assert E.speculative_config(d) == {"method": "dspark", "model": str(d.resolve()), "num_speculative_tokens": 4}


def _peagle_dir(tmp_path):
    d = tmp_path / "peagle"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "peagle", "mask_token_id": 1,
                                               "speculators_config": {"proposal_methods": [{"speculative_tokens": 4}]}}))
    (d / "model.safetensors").write_bytes(b"")
    return d


#: How vLLM 0.34's speculators loader answers a P-EAGLE checkpoint (bench/long_checks/vllm_conformance.py
#: runs the same check against 0.34's own algos.py).
def _loader_034(config_dict, pre_trained_config):  # noqa: ANN001, ANN202
    raise ValueError("P-EAGLE (parallel drafting EAGLE-3) is not supported.")


def test_p_eagle_is_served_as_eagle3_with_parallel_drafting_where_vllm_takes_it(tmp_path):
    from trainer_client.drafts import peagle

    assert peagle.vllm_refusal() is None  # vLLM 0.32 (this venv) serves it
    d = _peagle_dir(tmp_path)
    assert E.speculative_config(d) == {"method": "eagle3", "model": str(d.resolve()), "num_speculative_tokens": 4,
                                       "parallel_drafting": True}  # fmt: skip


def test_p_eagle_is_refused_where_vllms_loader_refuses_it_naming_the_version_and_what_instead(tmp_path, monkeypatch):
    """vLLM 0.34 does not serve P-EAGLE: hsstream eval, the launcher and the trainer's serve line
    say so, with the version and what to use instead, before any engine starts."""
    import vllm
    from typer.testing import CliRunner
    from vllm.transformers_utils.configs.speculators import algos

    from hsstream import launch
    from hsstream.cli import app
    from trainer_client.drafts.base import NotServable
    from trainer_client.drafts.peagle import PEagle

    monkeypatch.setitem(algos.SUPPORTED_SPECULATORS_TYPES, "peagle", _loader_034)
    d = _peagle_dir(tmp_path)
    want = rf"vLLM {vllm.__version__} does not serve P-EAGLE drafts \(it says: P-EAGLE .* is not supported\.\).*--draft dflash"
    with pytest.raises(E.DraftError, match=want):
        E.check_draft_dir(d)
    with pytest.raises(E.DraftError, match=want):
        launch.vllm_args(launch.VllmOptions(model=str(tmp_path), layer_ids=[], spool_dir="", notice_endpoint="",
                                            extraction=False, draft=str(d)))  # fmt: skip
    r = CliRunner().invoke(app, ["eval", "--draft", str(d), "--model", str(tmp_path)])
    assert r.exit_code == 2 and "does not serve P-EAGLE" in r.output and "Traceback" not in r.output, r.output
    with pytest.raises(NotServable, match=want):  # the trainer's serve line (here or not: vLLM refuses it)
        PEagle.serve_config(d, 4, here=False)


def test_read_prompts_jsonl_or_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n\nplain line\n')
    assert E.read_prompts(f) == ["a b", "plain line"]
    f.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="no string 'prompt'"):
        E.read_prompts(f)


def test_a_held_out_sample_prompts_with_what_comes_before_its_trained_tokens():
    ids = list(range(10, 20))
    assert E.sample_prompt(ids, [0, 0, 0, 1, 1, 1, 0, 0, 1, 1], None) == [10, 11, 12]  # a chat: up to the reply
    assert E.sample_prompt(ids, [1] * 10, None) == ids[:5]  # plain text trained everywhere: its first half
    assert E.sample_prompt(ids, None, None) == ids[:5]
    assert E.sample_prompt(ids, [1] * 10, 7) == ids[:7]  # regenerated: the prompt, not vLLM's reply
    assert E.sample_prompt([5], [1], None) == [5]


def test_job_prompts_are_the_samples_train_held_out(tmp_path, tiny_model):
    """Through the real sidecar app: the prompts come from exactly the samples the shared rule
    holds out (the trainer's side of it: tests/unit/trainer_client/test_trainer_loop.py)."""
    from fastapi.testclient import TestClient

    from connector.contract.holdout import held_out, sample_identity
    from connector.contract.rest_client import SidecarClient
    from connector.contract.settings import Settings
    from server.app import create_app

    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 model=tiny_model, api_token="t")  # fmt: skip
    rows = [{"token_ids": [100 + i] * 6, **({"id": f"r{i}"} if i % 3 else {})} for i in range(40)]
    with TestClient(create_app(s), raise_server_exceptions=False) as tc:
        c = SidecarClient(http=tc, token="t")
        job = c.create_job(rows).job_id
        want = [i for i in range(40) if held_out(sample_identity(rows[i].get("id"), i), 0.25, 3)]
        assert 0 < len(want) < 40
        prompts, info = E.job_prompts(c, job, 0.25, 3, limit=100, max_prompt_tokens=2)
        assert prompts == [[100 + i] * 2 for i in want]  # in index order, first half, cut to 2 tokens
        assert info == {"job": job, "eval_fraction": 0.25, "eval_seed": 3, "held_out_read": len(want)}
        assert len(E.job_prompts(c, job, 0.25, 3, limit=2)[0]) == 2
        with pytest.raises(ValueError, match="none of its 1 samples is held out"):
            E.job_prompts(c, c.create_job([{"token_ids": [1, 2], "id": "x"}]).job_id, 0.01, 0)
        with pytest.raises(ValueError, match="must be > 0"):
            E.job_prompts(c, job, 0.0)


def test_the_verifier_defaults_to_the_one_the_draft_names_if_it_is_here(tmp_path):
    d = tmp_path / "final"
    d.mkdir()
    assert E.draft_verifier(d) is None  # no config
    v = tmp_path / "verifier"
    v.mkdir()
    (d / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": str(v)}}}))
    assert E.draft_verifier(d) == str(v)
    (d / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "Qwen/Qwen3-8B"}}}))
    assert E.draft_verifier(d) is None  # a hub name: not here
    (d / "config.json").write_text("[]")
    assert E.draft_verifier(d) is None


def test_a_vllm_without_request_records_gives_no_agreement_and_a_table_of_vllms_figures(capsys):
    """vLLM 0.26 (the H200's) has no per_request_spec_decode_metrics: ``ours`` is None."""
    f = E.per_request_figures(records(0, 3), 3)
    vm = {**f, **E.summarise(f["drafts"], f["drafted"], f["accepted"], f["accepted_per_position"])}
    res = _res(None, vm)
    assert E.agreement(res) == float("inf")
    res.update(draft="d", prompts=2, max_tokens=8, num_speculative_tokens=3)
    res["temperatures"]["0.0"]["tokens_per_s"] = {"with_draft": 10.0, "without_draft": None}
    E.print_table(res)
    out = capsys.readouterr().out
    assert f"{vm['mean_acceptance_length']:.3f}" in out
    assert E.has_request_records() is True  # this host's vLLM 0.32 keeps them
