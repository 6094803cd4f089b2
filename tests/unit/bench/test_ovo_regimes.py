"""bench/online_vs_offline/ovo_regimes.py: the core split, the disk-limited shard plan, the fresh-reply count and
the checks that say a run is the regime it names (each shown failing on a run that is not)."""

from __future__ import annotations

import json

import pytest

from bench.online_vs_offline import ovo_regimes as R

SPLIT = {"producer": [0], "trainer": [1]}
AFF = {"producer": [0], "vllm_omp_threads_bind": "0", "trainer": [1]}


# ---------------------------------------------------------------------------------- core split


def test_cores_are_split_in_two_halves_apart_and_one_core_is_shared():
    assert R.split_cores({0, 1}) == SPLIT
    assert R.split_cores([3, 1, 2, 0]) == {"producer": [0, 1], "trainer": [2, 3]}
    assert R.split_cores({5}) == {"producer": [5], "trainer": [5]}
    with pytest.raises(ValueError):
        R.split_cores(set())
    assert R.omp_bind([0]) == "0" and R.omp_bind([0, 1, 2]) == "0-2" and R.omp_bind([0, 2]) == "0,2"


def test_affinity_must_be_recorded_in_every_arm_equal_and_apart():
    assert R.affinities_equal({"offline": {"affinity": AFF}, "online": {"affinity": dict(AFF)}})
    assert not R.affinities_equal({"offline": {"affinity": AFF}, "online": {}})  # not recorded
    other = {**AFF, "trainer": [0, 1]}  # the online trainer left on every core
    assert not R.affinities_equal({"offline": {"affinity": AFF}, "online": {"affinity": other}})
    shared = {"producer": [0, 1], "vllm_omp_threads_bind": "0-1", "trainer": [0, 1]}  # equal but not split
    assert not R.affinities_equal({"offline": {"affinity": shared}, "online": {"affinity": shared}})
    unread = {**AFF, "producer": []}  # vLLM's cores never read (it was gone): no pass
    assert not R.affinities_equal({"offline": {"affinity": unread}, "online": {"affinity": unread}})
    one = {"producer": [0], "vllm_omp_threads_bind": "0", "trainer": [0]}  # a one-core machine: shared, allowed
    assert R.affinities_equal({"offline": {"affinity": one}, "online": {"affinity": one}})


# ---------------------------------------------------------------------------------- shards


def test_shards_are_consecutive_cover_every_sample_once_and_each_fits_the_budget():
    sizes = [100 + 7 * (i % 5) for i in range(200)]
    budget = int(sum(sizes) * R.DISK_SHARE)
    shards = R.plan_shards(sizes, budget)
    assert len(shards) >= R.MIN_SHARDS
    assert [i for s in shards for i in s] == list(range(200))
    assert all(sum(sizes[i] for i in s) <= budget for s in shards)


def test_a_budget_that_fits_everything_still_gives_the_least_number_of_shards():
    shards = R.plan_shards([10] * 25, 10**9, min_shards=10)
    assert len(shards) == 10 and sorted(i for s in shards for i in s) == list(range(25)) and all(shards)


def test_a_sample_over_the_budget_or_too_few_samples_are_refused():
    with pytest.raises(ValueError, match="exceeds"):
        R.plan_shards([10] * 20 + [500], 100)
    with pytest.raises(ValueError, match="cannot make"):
        R.plan_shards([10] * 5, 100)


def test_the_size_estimate_counts_states_ids_and_header():
    assert R.sample_bytes_estimate(200, 4, 128) == 200 * (4 * 128 * 2 + 8) + 4096


# ---------------------------------------------------------------------------------- replies


def test_reply_differences_per_pair_of_epochs():
    rows = [(0, i, f"a{i}") for i in range(4)] + [(1, i, f"b{i}" if i < 3 else "a3") for i in range(4)]
    rows += [(2, i, f"b{i}") for i in range(4)]  # epoch 2 repeats epoch 1's replies for 0..2
    d = R.reply_differences(rows)
    assert [p["share"] for p in d["pairs"]] == [0.75, 0.25]
    assert d["min_share"] == 0.25
    assert R.reply_differences([(0, 0, "x")])["min_share"] is None  # one epoch: nothing to compare


# ---------------------------------------------------------------------------------- checks


def arms(steps_on: int = 96) -> dict:
    return {"offline": {"steps": 96, "affinity": AFF}, "online": {"steps": steps_on, "affinity": AFF}}


def test_the_balanced_checks_pass_in_range_and_fail_outside_or_on_unequal_steps():
    ok = R.regime_checks("balanced", {"arms": arms(), "balance_ratio": {"offline": 1.3}})
    assert all(ok.values()), ok
    assert not R.regime_checks("balanced", {"arms": arms(), "balance_ratio": {"offline": 0.3}})[
        "produce_over_train_step_in_range"
    ]
    assert not R.regime_checks("balanced", {"arms": arms(95), "balance_ratio": {"offline": 1.0}})["equal_steps_per_arm"]


def test_the_disk_limited_checks_fail_over_budget_with_few_shards_or_a_budget_not_a_tenth():
    d = {"budget": 1000, "dataset_bytes": 10_100, "offline_peak": 990, "shards": 11, "spool_peak": 800}
    assert all(R.regime_checks("disk_limited", {"arms": arms(), "disk": d}).values())
    for bad, name in (({"offline_peak": 1001}, "offline_peak_data_le_budget"),
                      ({"shards": 9}, "offline_shards_ge_min"),
                      ({"spool_peak": 1200}, "online_spool_peak_le_budget"),
                      ({"spool_peak": 0}, "online_spool_peak_le_budget"),  # nothing measured is no pass
                      ({"dataset_bytes": 4000}, "budget_is_a_tenth_of_the_dataset")):  # fmt: skip
        c = R.regime_checks("disk_limited", {"arms": arms(), "disk": {**d, **bad}})
        assert not c[name] and sum(not v for v in c.values()) == 1, (bad, c)


def test_the_fresh_replies_check_needs_half_of_the_replies_to_differ():
    good = {"min_share": 0.9}
    assert R.regime_checks("fresh_replies", {"arms": arms(), "reply_differences": good})[
        "fresh_replies_differ_between_epochs"
    ]
    for bad in ({"min_share": 0.4}, {"min_share": None}):
        assert not R.regime_checks("fresh_replies", {"arms": arms(), "reply_differences": bad})[
            "fresh_replies_differ_between_epochs"
        ]
    with pytest.raises(ValueError):
        R.regime_checks("default", {"arms": arms()})


def test_steps_are_compared_within_each_pair():
    a = {"offline_e1": {"steps": 10, "affinity": AFF}, "online_e1": {"steps": 10, "affinity": AFF},
         "offline_e3": {"steps": 30, "affinity": AFF}, "online_e3": {"steps": 29, "affinity": AFF}}  # fmt: skip
    pairs = [["offline_e1", "online_e1"], ["offline_e3", "online_e3"]]
    r = {"arms": a, "pairs": pairs, "balance_ratio": {"offline_e1": 1.0, "offline_e3": 1.0}}
    assert not R.regime_checks("balanced", r)["equal_steps_per_arm"]
    a["online_e3"]["steps"] = 30
    assert R.regime_checks("balanced", r)["equal_steps_per_arm"]


def test_time_to_reach_is_the_first_point_at_or_above():
    curve = [{"t_s": 5, "T0": 0.2}, {"t_s": 10, "T0": 0.5}, {"t_s": 15, "T0": 0.4}]
    assert R.time_to_reach(curve, 0.5, "T0") == 10 and R.time_to_reach(curve, 0.6, "T0") is None


# ---------------------------------------------------------------------------------- verifier


def test_the_padded_verifier_keeps_the_pretrained_models_outputs(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hsstream import tiny_model as tm

    src = tm.build_tiny_verifier()
    out = R.padded_verifier(src, 14, cache_root=tmp_path)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 14
    assert R.padded_verifier(src, 14, cache_root=tmp_path) == out  # cached
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    a = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    b = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        ha = a(ids, output_hidden_states=True)
        hb = b(ids, output_hidden_states=True)
    assert torch.allclose(ha.logits, hb.logits, atol=1e-5)
    for k in (2, 6, 9):
        assert torch.allclose(ha.hidden_states[k], hb.hidden_states[k])
    assert torch.equal(hb.hidden_states[12], hb.hidden_states[13])  # an appended layer changes nothing
    assert torch.allclose(hb.hidden_states[14], ha.hidden_states[12], atol=1e-5)  # the last (after the norm)
    assert R.layers_for(14) == [2, 6, 9, 14]


def test_the_estimate_scales_data_work_not_start_ups_and_counts_every_served_point():
    def arm(**kw):  # noqa: ANN003, ANN202
        return {"vllm_start_s": 40.0, "wall_s": 20.0, "result": {"wall_s": 10.0}, "curve": [{}, {}], **kw}

    smoke = {"arms": {"offline": arm(epochs=1, phases_s={"generate": 2.0}),
                      "online": arm(jobs=[{"options": {"epochs": 1}}])},
             "serving": {"wall_s": 250.0}, "wall_s_total": 400.0}  # fmt: skip
    small = R.Sizes(samples=40, epochs=(1,), max_points=2, grid_s=5.0)
    same = R.estimate_wall_s(smoke, small, small)
    assert same == 400  # the smoke itself: 2 x (40 + 20) + 250 + 30 left over
    big = R.Sizes(samples=400, epochs=(2,), max_points=4, grid_s=5.0)
    # offline: 40 + 8 fixed + 12 x 20; online: 40 + 10 + 10 x 20; serving 9 points of 50 s; 30 left over
    assert R.estimate_wall_s(smoke, small, big) == 40 + 8 + 240 + 40 + 10 + 200 + 450 + 30
