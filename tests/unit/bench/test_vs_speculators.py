"""bench/vs_speculators: the checks that make the headline study the comparison it claims (each
shown failing on a result that is not), the comparison's arithmetic, the doc section written from
the JSON, the sizes' time estimate and the data rules. No vLLM, no torch model: the result is
built here the way run.py builds it."""

from __future__ import annotations

import copy
from pathlib import Path
from collections import Counter

import pytest

from bench.vs_speculators import data as D
from bench.vs_speculators import plan as P
from bench.vs_speculators import results as R

AFF = {"producer": [0], "vllm_omp_threads_bind": "0", "trainer": [1]}
SETTINGS = {"draft_vocab_size": 4096, "aux_layer_ids": [2, 15, 27], "steps": 8, "samples_per_step": 1, "lr": 1e-3,
            "weight_decay": 0.01, "betas": [0.9, 0.999], "schedule": "cosine", "min_lr_ratio": 0.0, "warmup_steps": 0,
            "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "grad_clip": 1.0, "loss": "kl_div/eager",
            "draft_attn_impl": "sdpa", "seed": 0, "epochs": 1, "precision": "float32", "torch_threads": 1}  # fmt: skip
ARCH = {"draft_vocab_size": 4096, "norm_before_fc": False, "transformer_layer_config": {"hidden_size": 576}}


def point(t_s: float, step: int, m0: float, m1: float) -> dict:
    return {"step": step, "t_s": t_s, "prompts_hash": "p",
            "T0": {"mean_acceptance_length": m0, "acceptance_rate": (m0 - 1) / 3, "tokens_per_s": 50.0},
            "T1": {"mean_acceptance_length": m1, "acceptance_rate": (m1 - 1) / 3, "tokens_per_s": 45.0}}  # fmt: skip


def result() -> dict:
    """A complete result that passes every check: ours reaches speculators' final 1.60 at 30 s,
    speculators got there at 60 s."""
    ours = {"curve": [point(15, 4, 1.40, 1.20), point(30, 8, 1.70, 1.30)], "steps": 8, "samples_hash": "h",
            "sample_lengths": [128], "trained_keys": 8, "trained_twice": 0, "ledger_samples": 8,
            "job": {"done": True}, "spool_files_left": 0, "settings": dict(SETTINGS), "arch": dict(ARCH),
            "affinity": dict(AFF), "disk_peak_bytes": {"checkpoints": 10**8}, "shm_peak_bytes": 5 * 10**7}  # fmt: skip
    spec = {"curve": [point(40, 4, 1.30, 1.10), point(60, 8, 1.60, 1.25)], "steps": 8, "samples_hash": "h",
            "sample_lengths": [128], "hidden_state_files": 10, "settings": dict(SETTINGS), "arch": dict(ARCH),
            "affinity": dict(AFF), "disk_peak_bytes": {"hidden_states": 3 * 10**8, "checkpoints": 10**8},
            "shm_peak_bytes": 10**6}  # fmt: skip
    r = {"mode": "full", "date": "2026-12-05", "command": "python -m bench.vs_speculators", "wall_s_total": 3000.0,
         "verifier": {"label": "SmolLM2-135M-Instruct"},
         "sizes": {"conversations": 8, "val_rows": 2, "tokens": 128, "draft_vocab": 4096, "prompts": 4, "max_tokens": 16,
                   "points": 2},
         "data": {"train_hash": "h", "held_out_disjoint": True, "prompts_hash": "p", "ledger": {"accounted": True}},
         "arms": {"ours": ours, "speculators": spec}, "vocab_maps_equal": True,
         "untrained": {**point(0, 0, 1.01, 1.0), "prompts_hash": "p"}, "no_draft": {"T0": {"tokens_per_s": 40.0},
                                                                               "prompts_hash": "p"}}  # fmt: skip
    r["checks"] = R.checks(r)
    r["comparison"] = R.comparison(r)
    return r


def test_a_complete_result_passes_every_check():
    r = result()
    assert all(r["checks"].values()), [k for k, v in r["checks"].items() if not v]


@pytest.mark.parametrize(
    ("check", "spoil"),
    [
        ("same_samples", lambda r: r["arms"]["ours"].update(samples_hash="other")),
        ("same_samples", lambda r: r["data"].update(train_hash=None) or r["arms"]["ours"].update(samples_hash=None)
         or r["arms"]["speculators"].update(samples_hash=None)),
        ("samples_all_of_their_length", lambda r: r["arms"]["speculators"].update(sample_lengths=[96, 128])),
        ("held_out_disjoint", lambda r: r["data"].update(held_out_disjoint=False)),
        ("same_held_out_prompts", lambda r: r["arms"]["speculators"]["curve"][0].update(prompts_hash="q")),
        ("same_held_out_prompts", lambda r: r["untrained"].update(prompts_hash="q")),
        ("records_accounted", lambda r: r["data"]["ledger"].update(accounted=False)),
        ("ours_every_sample_trained_once", lambda r: r["arms"]["ours"].update(trained_twice=1)),
        ("ours_every_sample_trained_once", lambda r: r["arms"]["ours"].update(trained_keys=7)),
        ("ours_every_sample_trained_once", lambda r: r["arms"]["ours"]["job"].update(done=False)),
        ("speculators_every_sample_written_and_trained", lambda r: r["arms"]["speculators"].update(hidden_state_files=9)),
        ("speculators_every_sample_written_and_trained", lambda r: r["arms"]["speculators"].update(steps=7)),
        ("spool_empty_after_ours", lambda r: r["arms"]["ours"].update(spool_files_left=2)),
        ("same_settings", lambda r: r["arms"]["speculators"]["settings"].update(lr=2e-3)),
        ("same_settings", lambda r: r["arms"]["speculators"]["settings"].update(betas=[0.9, 0.95])),
        ("same_settings", lambda r: r["arms"]["ours"]["settings"].pop("warmup_steps")),
        ("same_settings", lambda r: r["arms"]["ours"]["settings"].update(samples_per_step=2)),
        ("same_draft_architecture", lambda r: r["arms"]["speculators"]["arch"].update(norm_before_fc=True)),
        ("same_draft_architecture", lambda r: r["arms"]["ours"].update(arch={}) or r["arms"]["speculators"].update(arch={})),
        ("same_vocab_maps", lambda r: r.update(vocab_maps_equal=False)),
        ("same_cores", lambda r: r["arms"]["ours"].update(affinity={**AFF, "trainer": [0, 1]})),
        ("same_cores", lambda r: r["arms"]["speculators"].update(affinity=None)),
        ("points_per_curve_ge_min", lambda r: r["arms"]["ours"]["curve"].pop(0)),
        ("curves_complete", lambda r: r["arms"]["speculators"]["curve"][1]["T1"].update(mean_acceptance_length=None)),
        ("curves_complete", lambda r: r["arms"]["ours"]["curve"][1].update(t_s=10)),
    ],
)
def test_each_check_fails_on_a_result_that_is_not_the_comparison(check, spoil):
    r = result()
    spoil(r)
    c = R.checks(r)
    assert not c[check]
    assert all(v for k, v in c.items() if k != check), [k for k, v in c.items() if not v]


def test_settings_compare_floats_closely_and_need_both_sides():
    a = dict(SETTINGS)
    assert all(R.settings_equal(a, {**a, "lr": 0.001 + 1e-18}).values())
    assert not R.settings_equal(a, {**a, "lr": 0.0011})["lr"]
    assert not R.settings_equal(a, {**a, "ttt_steps": None})["ttt_steps"]
    assert not R.settings_equal(a, {**a, "precision": "bfloat16"})["precision"]


def test_the_architecture_ignores_paths_and_dtypes_only():
    cfg = {"draft_vocab_size": 8, "norm_output": False, "speculators_config": {"verifier": {"name_or_path": "/a"}},
           "transformer_layer_config": {"hidden_size": 4, "dtype": "float32", "sliding_window": 4096}}  # fmt: skip
    other = copy.deepcopy(cfg)
    other["speculators_config"]["verifier"]["name_or_path"] = "/b"
    other["transformer_layer_config"]["dtype"] = "bfloat16"
    assert R.arch_of(cfg) == R.arch_of(other)
    other["transformer_layer_config"]["sliding_window"] = 2048
    assert R.arch_of(cfg) != R.arch_of(other)


def test_the_comparison_says_when_ours_reaches_their_final_figure():
    c = result()["comparison"]
    assert c["speculators_final"] == {"t_s": 60, "T0": 1.60, "T1": 1.25}
    assert c["ours_reaches_speculators_final_at_s"] == 30 and c["ours_reaches_no_later"] and c["ours_wall_saved_s"] == 30
    assert c["trained_minus_untrained_T0"] == {"ours": pytest.approx(0.69), "speculators": pytest.approx(0.59)}
    assert "30 s earlier" in R.verdict(result())


def test_the_comparison_says_so_when_ours_is_later_or_never_gets_there():
    r = result()
    r["arms"]["ours"]["curve"] = [point(50, 4, 1.40, 1.2), point(90, 8, 1.65, 1.3)]
    c = R.comparison(r)
    assert c["ours_reaches_speculators_final_at_s"] == 90 and not c["ours_reaches_no_later"]
    r["comparison"] = c
    assert "does **not**" in R.verdict(r) and "30 s after" in R.verdict(r)
    r["arms"]["ours"]["curve"] = [point(20, 4, 1.40, 1.2), point(30, 8, 1.50, 1.3)]
    r["comparison"] = R.comparison(r)
    assert r["comparison"]["ours_reaches_speculators_final_at_s"] is None and not r["comparison"]["ours_reaches_no_later"]
    assert "0.100 short" in R.verdict(r)


def test_the_doc_section_is_written_from_the_json_and_says_so_without_one():
    r = result()
    s = R.doc_section(r, "bench/results/vs_speculators_cpu.json")
    assert s.startswith(R.DOC_BEGIN) and s.endswith(R.DOC_END)
    assert "| ours (online) | 8 | 30 | 1.700 / 1.300 |" in s and "| speculators (offline) | 8 | 60 | 1.600 / 1.250 |" in s
    assert "Every check passed." in s
    r["checks"]["same_cores"] = False
    assert "**Checks failed: same_cores.**" in R.doc_section(r, "x.json")
    none = R.doc_section(None, "bench/results/vs_speculators_cpu.json")
    assert R.NOT_RUN in none and "|" not in none
    doc = f"# B\n\ntext\n{none}\nmore\n"
    new = R.replace_section(doc, s)
    assert R.current_section(new) == s and new.startswith("# B\n\ntext\n") and new.endswith("\nmore\n")
    with pytest.raises(ValueError, match="markers"):
        R.replace_section("# B\n", s)


def test_the_full_sizes_are_what_the_estimate_fits_in_an_hour():
    assert P.fit(3600) == P.FULL
    e = P.estimate_s(P.FULL)
    assert e["total"] <= 3600 and P.FULL.conversations >= 2000
    # what gives way first is the vocabulary, then the tokens per sample, never the conversations first
    slow = {"train_tok_s": 120.0}
    z = P.fit(3600, slow)
    assert z.conversations == P.FULL.conversations and z.draft_vocab == 4096 and z.tokens < P.FULL.tokens
    assert P.train_tok_s(P.DEFAULT_RATES, 4096) > P.train_tok_s(P.DEFAULT_RATES, 8192)


def test_pick_takes_one_checkpoint_per_share_of_the_steps_and_the_last():
    from bench.vs_speculators.run import pick

    ck = [{"step": s} for s in (500, 1000, 1500, 1996, 1997, 1998, 2000)]
    assert [c["step"] for c in pick(ck, 2000, 4)] == [500, 1000, 1500, 2000]
    assert [c["step"] for c in pick([{"step": 20}, {"step": 40}], 40, 2)] == [20, 40]
    assert pick([], 10, 2) == []


# ---------------------------------------------------------------------------------- data rules


@pytest.mark.parametrize(
    ("conv", "why"),
    [
        ([], "empty"),
        ([{"from": "gpt", "value": "hi"}, {"from": "human", "value": "yo"}], "assistant_first"),
        ([{"from": "human", "value": "a"}, {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}], "not_alternating"),
        ([{"from": "human", "value": "a"}, {"from": "gpt", "value": " "}], "empty_turn"),
        ([{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}], "unknown_speaker"),
        ([{"from": "human", "value": "a"}, {"from": "system", "value": "s"}, {"from": "gpt", "value": "b"}], "system_inside"),
        ([{"from": "human", "value": "a"}], "no_reply"),
    ],
)
def test_conversations_the_rules_skip_say_why(conv, why):
    assert D.normalize({"conversations": conv}) == (None, why)


def test_speakers_are_mapped_and_only_the_first_turns_kept():
    conv = [{"from": "system", "value": "s"}, {"from": "user", "value": "q1"}, {"from": "chatgpt", "value": "a1"},
            {"from": "human", "value": "q2"}, {"from": "bard", "value": "a2"}, {"from": "human", "value": "q3"},
            {"from": "bing", "value": "a3"}]  # fmt: skip
    out, why = D.normalize({"conversations": conv})
    assert why == "" and [t["from"] for t in out] == ["system", "human", "gpt", "human", "gpt"]
    assert [t["value"] for t in out] == ["s", "q1", "a1", "q2", "a2"]


def test_the_ledger_accounts_for_every_record_read():
    led = D.Ledger(read=10, skipped=Counter(empty=2, too_short=1), train=4, val=1, held_out=2)
    assert led.accounted()
    led.read = 11
    assert not led.accounted() and not led.as_dict()["accounted"]


def test_held_out_prompts_must_differ_from_every_trained_conversation_and_prefix():
    conv = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    s = D.Sample("1", conv, [5, 6, 7, 8, 9], [0, 0, 1, 1, 1])
    fresh = D.Prompt("2", D.conversation_hash([{"from": "human", "value": "x"}]), [5, 4])
    assert D.held_out_disjoint([fresh], [s])
    assert not D.held_out_disjoint([D.Prompt("3", D.conversation_hash(conv), [1, 2])], [s])  # the same conversation
    assert not D.held_out_disjoint([D.Prompt("4", "other", [5, 6])], [s])  # a trained sample's prompt
    assert not D.held_out_disjoint([D.Prompt("5", "other", [5, 6, 7])], [s])  # a prefix of a trained sample
    assert D.set_hash(["b", "a", "a"]) == D.set_hash(["a", "b"]) != D.set_hash(["a"])
    assert D.sample_digest([1, 2], [0, 1]) != D.sample_digest([1, 2], [1, 1])


# ---------------------------------------------------------------------------------- the two commands


def test_speculators_train_flags_resolve_to_the_shared_recipe():
    """The flags the speculators arm passes, through speculators' own resolver, are the recipe
    (a flag it ignored or renamed would leave its default: Muon, linear, norms, window 2048)."""
    from pathlib import Path

    from speculators.train.config import TrainConfig

    from bench.vs_speculators import theirs as T

    rc, z = P.RECIPE, P.FULL
    args = T.train_args("/v", Path("/p"), Path("/h"), Path("/s"), Path("/l"), z, rc, [2, 15, 27], T.ratio_for(2000, 20))
    c = TrainConfig.resolve(args).flatten()
    assert (c["optimizer"], c["lr"], c["weight_decay"], c["scheduler_type"]) == ("adamw", rc.lr, rc.weight_decay, "cosine")
    assert (c["ttt_steps"], c["ttt_step_loss_decay"], c["loss_fn"], c["loss_implementation"]) == (3, 1.0, "kl_div", "eager")
    assert (c["norm_before_residual"], c["norm_before_fc"], c["norm_output"], c["fc_norm"]) == (True, False, False, False)
    assert (c["num_layers"], c["draft_arch"], c["sliding_window"], c["full_attention_indices"]) == (1, "llama", 4096, [0])
    assert (c["draft_attn_impl"], c["hidden_states_dtype"], c["num_workers"], c["seed"]) == ("sdpa", "float32", 0, 0)
    assert (c["target_layer_ids"], c["draft_vocab_size"], c["total_seq_len"], c["epochs"]) == ([2, 15, 27], 4096, 128, 1)
    assert c["checkpoint_freq"] == 0.25 and c["on_missing"] == "raise" and c["scheduler_warmup_steps"] is None
    assert int(2020 * c["train_data_ratio"]) == 2000


def test_hsstream_train_flags_resolve_to_the_shared_recipe():
    import yaml
    from typer.testing import CliRunner

    from bench.vs_speculators import ours as O
    from hsstream.cli import app

    class StackAddresses:  # the addresses a stack gives the trainer's command line; nothing started
        api, delivery_endpoint, spool = "http://127.0.0.1:1", "ipc:///tmp/x.sock", "/dev/shm/x"

    rc, z = P.RECIPE, P.FULL
    cmd = O.train_command("/v", Path("/r"), "job1", StackAddresses, Path("/p/token_freq.pt"), z, rc, [2, 15, 27], 2000)
    res = CliRunner().invoke(app, [*cmd[3:], "--dump-config"])
    assert res.exit_code == 0, res.output
    c = yaml.safe_load(res.output)
    assert (c["lr"], c["weight_decay"], c["betas"], c["schedule"], c["min_lr_ratio"]) == (rc.lr, rc.weight_decay, [0.9, 0.999], "cosine", 0.0)
    assert (c["warmup_steps"], c["grad_clip"], c["ttt_steps"], c["ttt_step_loss_decay"]) == (20, 1.0, 3, 1.0)
    assert (c["samples_per_step"], c["max_tokens_per_step"], c["draft_attn_impl"], c["seed"]) == (1, 128, "sdpa", 0)
    assert (c["aux_layer_ids"], c["draft_vocab_size"], c["checkpoint_every"], c["keep_checkpoints"]) == ([2, 15, 27], 4096, 500, 0)
    assert (c["threads"], c["device"], c["autocast"], c["jobs"], c["token_counts"]) == (1, "cpu", "none", ["job1"], "/p/token_freq.pt")


def test_speculators_split_and_order_one_sample_a_step():
    from bench.vs_speculators import theirs as T

    for n, v in ((2000, 20), (40, 4), (7, 1)):
        r = T.ratio_for(n, v)
        assert int((n + v) * r) == n
    batches = T.trainer_order([128] * 50, 128, 0)
    assert sorted(b[0] for b in batches) == list(range(50)) and all(len(b) == 1 for b in batches)
    assert batches == T.trainer_order([128] * 50, 128, 0) != T.trainer_order([128] * 50, 128, 1)
    # shorter samples would be packed several to a step: the steps check then sees it
    assert any(len(b) > 1 for b in T.trainer_order([60] * 50, 128, 0))


def test_speculators_vllm_command_is_launch_vllm_s():
    import json
    from pathlib import Path

    from bench.vs_speculators import theirs as T

    cmd = T.vllm_command("/v", Path("/hs"), 8123, [2, 15, 27, 30], 1024)
    i = cmd.index("--speculative-config")
    assert json.loads(cmd[i + 1])["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    k = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    # speculators' file backend's config; on a machine without CUDA only the class is the CPU-safe subclass
    assert {**k, "kv_connector": "ExampleHiddenStatesConnector", "kv_connector_module_path": None} == {
        "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer", "kv_connector_module_path": None,
        "kv_connector_extra_config": {"shared_storage_path": "/hs"}}  # fmt: skip
    assert k["kv_connector"] in ("ExampleHiddenStatesConnector", "CpuExampleHiddenStatesConnector")
    # the CPU-safe class exists where the config says (read, not imported: that would load vLLM)
    mod = Path(__file__).resolve().parents[3] / (T.CPU_CONNECTOR["kv_connector_module_path"].replace(".", "/") + ".py")
    assert f"class {T.CPU_CONNECTOR['kv_connector']}(ExampleHiddenStatesConnector)" in mod.read_text()
    with pytest.raises(ValueError):
        T.cpu_safe({"kv_connector": "Other"})
    assert cmd[2:5] == ["vllm.entrypoints.openai.api_server", "--model", "/v"] and "--no-enable-prefix-caching" in cmd


def test_our_settings_come_from_the_trainers_run_json_draft_options_included():
    """run.json keeps Eagle-3's own settings under ``draft_options``: the settings compared are
    read from there, so a draft trained with other TTT steps fails ``same_settings``."""
    from bench.vs_speculators.run import ours_settings

    cfg = {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "schedule": "cosine", "min_lr_ratio": 0.0,
           "warmup_steps": 0, "grad_clip": 1.0, "seed": 0, "threads": 1,
           "draft_options": {"draft_attn_impl": "sdpa", "ttt_steps": 3, "ttt_step_loss_decay": 1.0}}  # fmt: skip
    o = {"run": {"config": cfg, "draft_vocab_size": 4096, "aux_layer_ids": [2, 15, 27], "autocast": None},
         "steps": 8, "trained_keys": 8, "job_options": {}}  # fmt: skip
    got = ours_settings(o, 8)
    assert {k: got[k] for k in SETTINGS} == SETTINGS
    r = result()
    r["arms"]["ours"]["settings"] = got
    assert R.checks(r)["same_settings"]
    cfg["draft_options"]["ttt_steps"] = 2
    r["arms"]["ours"]["settings"] = ours_settings(o, 8)
    assert not R.checks(r)["same_settings"]


def test_a_trainers_cpu_seconds_are_measured_and_used_on_a_loaded_machine(tmp_path):
    """finish_cpu counts the child's own CPU seconds (a busy child ~its wall, a sleeping one ~0);
    measured_rates takes the training rate from them when the run's machine was loaded."""
    import sys

    from bench.vs_speculators.common import finish_cpu, spawn_pinned
    from bench.vs_speculators.run import measured_rates

    busy = spawn_pinned([sys.executable, "-c", "import time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass"],
                        None, tmp_path / "busy.log")  # fmt: skip
    idle = spawn_pinned([sys.executable, "-c", "import time; time.sleep(0.6)"], None, tmp_path / "idle.log")
    (c1, busy_s), (c2, idle_s) = finish_cpu(busy, 30), finish_cpu(idle, 30)
    assert c1 == c2 == 0 and busy_s >= 0.55 and idle_s < 0.4

    def run_result(load: float) -> dict:
        spec = {"checkpoints": [{"step": 50, "t_s": 100.0}, {"step": 100, "t_s": 300.0}], "steps": 100,
                "trainer_cpu_s": 40.0, "vllm_start_s": 60.0, "curve": []}  # fmt: skip
        return {"sizes": {"conversations": 100, "val_rows": 4, "tokens": 96, "prompts": 8, "max_tokens": 32},
                "machine": {"cpus": 2, "loadavg_at_end": [load, load, load]}, "untrained": {"engine_wall_s": 50.0},
                "arms": {"speculators": spec, "ours": {"vllm_start_s": 60.0, "curve": []}}}  # fmt: skip

    assert measured_rates(run_result(0.5))["train_tok_s"] == 50 * 96 / 200.0  # quiet: between checkpoints
    assert measured_rates(run_result(15.0))["train_tok_s"] == 100 * 96 / 40.0  # loaded: CPU seconds
