"""bench/arena/arena.py's figures from its rounds: percentiles, per-sample CPU and bytes, the arms'
JSON keys issue 26 names, and the acceptance checks (each seen failing on a run that misses it)."""

from __future__ import annotations

from bench.arena import arena as B

REQUIRED = {"p50_ms", "p99_ms", "cpu_ms_per_sample", "bytes_copied_per_sample", "samples_per_s"}


def a_round(lat: list[float], *, n: int = 10, cpu: float = 1.0, copied: int | None = 100, rate: float = 20.0) -> dict:
    return {"latency_ms": lat, "hops_ms": {"read_check": [x / 2 for x in lat]},
            "saturated": {"samples": n, "latency_ms": [2 * x for x in lat], "samples_per_s": rate,
                          "cpu_s": {"connector": cpu, "sidecar": cpu / 10, "stream": cpu / 2},
                          "bytes_copied": {"connector": copied, "stream": None if copied is None else copied // 2}}}  # fmt: skip


def test_pctl_is_nearest_rank_and_none_when_empty():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert B.pctl(xs, 0.5) == 3.0 and B.pctl(xs, 0.0) == 1.0 and B.pctl(xs, 1.0) == 5.0
    assert B.pctl(list(range(101)), 0.99) == 99
    assert B.pctl([], 0.5) is None


def test_an_arm_pools_latencies_and_takes_per_sample_medians():
    s = B.summarize_arm([a_round([10.0, 20.0, 30.0]), a_round([40.0, 50.0, 60.0, 70.0, 80.0], cpu=3.0, rate=30.0)])
    assert REQUIRED <= set(s)
    # pooled over the rounds' samples (the median of the rounds' p50s would be 40)
    assert s["p50_ms"] == 50.0 and s["p99_ms"] == 80.0 and s["latency_samples"] == 8
    assert s["p50_ms_per_round"] == [20.0, 60.0] and s["saturated"]["p50_ms"] == 100.0
    assert s["cpu_ms_per_sample"]["connector"] == 200.0  # median of 100 and 300 ms over 10 samples
    assert s["cpu_ms_per_sample"]["total"] == round(200.0 * 1.6, 3)
    assert s["bytes_copied_per_sample"] == {"connector": 10.0, "stream": 5.0, "total": 15.0}
    assert s["samples_per_s"] == 25.0 and s["hop_p50_ms"]["read_check"] == 25.0


def test_a_counter_missing_in_a_round_gives_no_bytes_figure():
    s = B.summarize_arm([a_round([1.0]), a_round([1.0], copied=None)])
    assert s["bytes_copied_per_sample"]["stream"] is None and s["bytes_copied_per_sample"]["total"] is None


def test_the_checks_pass_a_faster_leaner_arena_and_fail_otherwise():
    files = B.summarize_arm([a_round([10.0] * 5, copied=300)])
    good = B.summarize_arm([a_round([6.0] * 5, copied=100)])
    ratios, checks = B.compare(files, good)
    assert ratios["p50"] == 0.6 and ratios["bytes_copied_per_sample"]["total"] == round(150 / 450, 4)
    assert checks == {"p50_ratio_le_0.6": True, "fewer_bytes_copied": True}
    _, slow = B.compare(files, B.summarize_arm([a_round([6.1] * 5, copied=100)]))
    assert slow == {"p50_ratio_le_0.6": False, "fewer_bytes_copied": True}
    _, fat = B.compare(files, B.summarize_arm([a_round([5.0] * 5, copied=300)]))  # as many bytes: not fewer
    assert fat == {"p50_ratio_le_0.6": True, "fewer_bytes_copied": False}
    _, blind = B.compare(files, B.summarize_arm([a_round([5.0] * 5, copied=None)]))  # no counter: no pass
    assert blind["fewer_bytes_copied"] is False


def test_a_round_is_ok_only_when_every_sample_was_consumed_and_yielded_from_its_layout():
    job = {"samples": 4, "consumed": 4, "failed": 0, "yielded": 4, "from_slots": 0}
    assert B.ok_round({"arm": "files", "saturated": job, "paced": dict(job)})
    assert not B.ok_round({"arm": "files", "saturated": {**job, "consumed": 3}})
    assert not B.ok_round({"arm": "files", "saturated": job, "paced": {**job, "failed": 1}})
    slots = {**job, "from_slots": 4}
    assert B.ok_round({"arm": "arena", "saturated": slots, "paced": dict(slots)})
    assert not B.ok_round({"arm": "arena", "saturated": slots, "paced": {**slots, "from_slots": 3}})  # one was a file
    assert not B.ok_round({"arm": "files", "saturated": slots})  # files measured from slots


def test_the_stand_in_writes_what_the_stream_accepts_with_the_connectors_own_code(tmp_path):
    """The stand-in's sample (scheduler side, worker side, gatherer, writer, notice socket) is the
    rows of the request's scattered blocks, in the layer order asked for, read back and checked by
    the stream's own reader; a wrong expectation (other token ids) is refused by that reader."""
    import threading

    import pytest
    import torch
    import zmq

    from connector import protocol as P
    from trainer_client.sample_checks import load_and_check

    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    ep = f"ipc://{tmp_path}/notice.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(ep)
    layers, n = [3, 1], 40  # not ascending (vLLM stores ascending: a permutation), not whole blocks
    si = B.StandIn(str(spool), ep, layer_ids=layers, num_hidden_layers=4, hidden=64, tokens=n, block_size=16,
                   cache_requests=2)  # fmt: skip
    t = threading.Thread(target=si.engine, daemon=True)
    t.start()
    try:
        ids = list(range(7, 7 + n))
        tag = P.RequestTag(key=P.SampleKey(job="j", index=0), attempt=1)
        out = si.complete({"prompt": ids, "kv_transfer_params": P.kv_params_for(tag)})
        assert out["kv_transfer_params"]
        assert pull.poll(20_000), "no notice from the stand-in's writer"
        notice = P.Notice.decode(pull.recv())
        assert notice.status == P.NoticeStatus.ok and notice.key == tag.key and notice.layer_ids == layers
        smp = load_and_check(spool, P.Deliver(notice=notice, expected_token_ids=ids))
        blocks = [si.order[i] for i in range(-(-n // 16))]
        want = si.cache[blocks].reshape(-1, 2, 64)[:n][:, [1, 0]]  # storage [1, 3] -> asked [3, 1]
        assert torch.equal(smp.hidden_states, want) and smp.token_ids.tolist() == ids
        with pytest.raises(P.InvalidSample):
            load_and_check(spool, P.Deliver(notice=notice, expected_token_ids=[0] * n))
        assert si.stats()["steps"] == 1
    finally:
        si.close()
        t.join(10)
        pull.close(linger=0)


def test_latency_is_named_over_every_sample_over_each_jobs_window_and_over_its_start():
    """A job whose first 3 samples stall (yielded at once at 1 s): the window (10-90 % of the
    job's yield times) leaves them out, every sample and the first 32 keep them."""
    lat = [1000.0, 990.0, 980.0] + [5.0] * 37
    ys = [1.0, 1.0, 1.0] + [1.0 + 0.1 * i for i in range(1, 38)]
    rnd = {**a_round([1.0]), "latency_ms": lat, "yield_s": ys}
    rnd["saturated"] = {**rnd["saturated"], "latency_ms": lat, "yield_s": ys}
    s = B.summarize_arm([rnd, {**rnd}])
    assert s["all"] == {"p50_ms": 5.0, "p99_ms": 1000.0, "max_ms": 1000.0, "n": 80}
    assert s["window"]["max_ms"] == 5.0 and s["window"]["n"] < 80
    assert s["first_32_p99_ms"] == [1000.0, 1000.0] and s["saturated"]["all"]["max_ms"] == 1000.0
    assert s["p50_ms"] == 5.0 and s["p99_ms"] == 1000.0  # the keys the docs quote: every paced sample
