"""bench/online_gpu/online_gpu.py's latency breakdown: the sidecar's hop split by the stamps it adds."""

from __future__ import annotations

import pytest

from bench.online_gpu import online_gpu as O


def test_the_sidecar_hop_is_split_by_its_stamps_and_the_connectors_stages_keep_their_prefix():
    rec = {"sent": 100.0, "conn": {"write": 0.014, "sidecar_in": 0.0005, "sidecar_queue": 0.0015},
           "stream": {"received": 100.0025, "started": 100.003, "checked": 100.010, "handed": 100.0102},
           "y": 100.0103, "g": 100.0104}  # fmt: skip
    b = O.breakdown([rec])
    assert b["connector_write"]["p50_ms"] == pytest.approx(14.0)
    assert b["sidecar"]["p50_ms"] == pytest.approx(2.5)
    assert b["sidecar_in"]["p50_ms"] == pytest.approx(0.5) and b["sidecar_queue"]["p50_ms"] == pytest.approx(1.5)
    assert b["sidecar_to_trainer"]["p50_ms"] == pytest.approx(0.5)  # what is left of the 2.5
    assert "connector_sidecar_in" not in b
    old = {**rec, "conn": {"write": 0.014}}  # a notice from before the stamps: no split, no error
    assert "sidecar_to_trainer" not in O.breakdown([old]) and "sidecar" in O.breakdown([old])


def _stream_run(config: str, layout: str, p50: float, p99: float, read_p50: float) -> dict:
    return {"config": config, "spool_layout": layout, "latency_notice_to_gpu_ms": {"p50": p50, "p99": p99},
            "delivered_to_trainer_gpu": {"tok_per_s": 1000.0}, "ratio_to_plain": 0.9, "vllm_ratio_to_plain": 0.95,
            "breakdown": {"check_read": {"p50_ms": read_p50, "p99_ms": 2 * read_p50, "mean_ms": read_p50},
                          "needed": True}, "spool": {"peak_bytes": 10 if layout == "files" else 999, "budget_bytes": 100}, "kv_cache_tokens": [1]}


def test_the_summary_keeps_each_spool_layout_apart_and_divides_arena_by_files(capsys):
    runs = [{"config": "plain", "rate": {"tok_per_s": 1100.0}, "kv_cache_tokens": [1]},
            _stream_run("stream", "files", 20.0, 40.0, 4.0), _stream_run("stream_arena", "arena", 10.0, 30.0, 0.5),
            _stream_run("stream", "files", 30.0, 60.0, 6.0), _stream_run("stream_arena", "arena", 14.0, 34.0, 1.5)]
    doc = {"runs": runs}
    O.summarize(doc)
    s = doc["summary"]
    f, a = s["by_spool_layout"]["files"], s["by_spool_layout"]["arena"]
    assert (f["latency_p50_ms"], f["latency_p99_ms"], f["runs"]) == (25.0, 50.0, 2)
    assert (a["latency_p50_ms"], a["latency_p99_ms"], a["configs"]) == (12.0, 32.0, ["stream_arena"])
    assert a["breakdown"]["check_read"] == {"p50_ms": 1.0, "p99_ms": 2.0} and "needed" not in a["breakdown"]
    assert f["breakdown"]["check_read"]["p50_ms"] == 5.0
    assert s["arena_vs_files_p50"] == pytest.approx(12.0 / 25.0, abs=1e-4)
    assert s["arena_vs_files_p99"] == pytest.approx(32.0 / 50.0, abs=1e-4)
    assert s["peak_spool_bytes"] == 10  # the arena's file is the budget's size from the start: not a peak
    assert s["latency_p50_ms"] == 25.0  # "stream" alone, as before
    assert "spool layout arena" in capsys.readouterr().out


def test_without_an_arena_run_there_is_no_ratio():
    doc = {"runs": [_stream_run("stream", "files", 20.0, 40.0, 4.0)]}
    O.summarize(doc)
    assert doc["summary"]["arena_vs_files_p50"] is None and set(doc["summary"]["by_spool_layout"]) == {"files"}


def test_fp8_encoded_on_the_device_is_summarised_apart_from_the_hosts_and_on_a_stack_of_its_own():
    from bench.online_gpu.online_gpu_config import stack_kind

    assert stack_kind("stream_fp8_device") == ("files", True) and stack_kind("stream") == ("files", False)
    assert stack_kind("stream_arena") == ("arena", False)
    host, dev = _stream_run("stream", "files", 20.0, 40.0, 4.0), _stream_run("stream_fp8_device", "files", 15.0, 30.0, 4.0)
    bf16 = _stream_run("stream", "files", 99.0, 99.0, 4.0)  # another payload: not in the FP8 comparison
    for r in (host, dev):
        r["payload_dtype"] = "fp8_e4m3"
    doc = {"runs": [{"config": "plain", "rate": {"tok_per_s": 1100.0}, "kv_cache_tokens": [1]}, host, dev, bf16]}
    O.summarize(doc)
    s = doc["summary"]
    assert s["by_fp8_encoding"]["host"]["latency_p50_ms"] == 20.0
    assert s["by_fp8_encoding"]["device"]["latency_p50_ms"] == 15.0
    assert s["fp8_device_vs_host_p50"] == 0.75
    assert s["by_spool_layout"]["files"]["configs"] == ["stream"]  # the device arm is not a files-layout row


def test_the_device_fp8_arm_needs_an_fp8_payload(capsys):
    from bench.online_gpu.online_gpu_config import parser, resolve

    ap = parser(None)
    with pytest.raises(SystemExit):
        resolve(ap, ap.parse_args(["--configs", "stream_fp8_device", "--dry-run"]))
    assert "needs --payload-dtype fp8_e4m3" in capsys.readouterr().err
    resolve(ap, ap.parse_args(["--configs", "stream_fp8_device", "--payload-dtype", "fp8_e4m3", "--dry-run"]))


def test_latency_is_given_over_the_window_over_every_sample_and_over_the_jobs_start():
    """A job whose first 30 samples wait until 0.3 s after the first notice (a start-up stall):
    delivered first, they fall before the window (10-90 % of deliveries), so its p99 hides them;
    the figures over every sample and over the first 32 show them, each named."""
    recs = []
    for i in range(400):
        sent = 100.0 + 0.01 * i
        g = 100.3 + 0.0001 * i if i < 30 else sent + 0.005
        recs.append({"sent": sent, "g": g, "y": g})
    lat = O.latency(recs)
    assert lat["window"] == [0.1, 0.9] and lat["p99"] == pytest.approx(5.0) and lat["n"] < 400
    assert lat["all"]["n"] == 400 and lat["all"]["max"] == pytest.approx(300.0) and lat["all"]["p99"] > 200
    assert lat["first_32"]["n"] == 32 and lat["first_32"]["p99"] == pytest.approx(300.0)
    assert len(lat["samples_ms"]) == 400 and lat["samples_ms"][0] == pytest.approx(300.0)


def test_the_summary_names_the_window_and_every_sample_figures(capsys):
    recs_ok = [{"sent": 1.0 + i, "g": 1.01 + i, "y": 1.01 + i} for i in range(100)]
    recs_stall = [{**x, "g": x["g"] + (2.0 if i < 5 else 0.0)} for i, x in enumerate(recs_ok)]
    runs = [{"config": "plain", "rate": {"tok_per_s": 1100.0}, "kv_cache_tokens": [1]}]
    for cfg, lay, recs in (("stream", "files", recs_ok), ("stream_arena", "arena", recs_stall)):
        r = _stream_run(cfg, lay, 0.0, 0.0, 1.0)
        r["latency_notice_to_gpu_ms"] = O.latency(recs)
        runs.append(r)
    doc = {"runs": runs}
    O.summarize(doc)
    s, a = doc["summary"], doc["summary"]["by_spool_layout"]["arena"]
    assert s["latency_all_p99_ms"] == pytest.approx(10.0) and s["latency_all_max_ms"] == pytest.approx(10.0)
    assert a["latency_all_p99_ms"] == pytest.approx(2010.0) and a["first_p99_ms"] == pytest.approx(2010.0)
    assert s["arena_vs_files_all_p99"] == pytest.approx(201.0)
    out = capsys.readouterr().out
    assert "arena: notice -> trainer GPU, steady-state window" in out and "arena: notice -> trainer GPU, every sample" in out
    assert "each job's first 32: p99 2010.0 ms" in out


def test_forward_end_to_gpu_adds_the_connectors_stages_to_notice_to_gpu():
    conn = {"gather": 0.001, "queue": 0.002, "copy_wait": 0.003, "checksum": 0.004, "write": 0.005}
    rec = {"sent": 100.0, "g": 100.010, "y": 100.010, "conn": conn, "stream": {}}
    b = O.breakdown([rec])
    assert b["forward_end_to_gpu"]["p50_ms"] == pytest.approx(25.0) and b["connector_queue"]["p50_ms"] == pytest.approx(2.0)
    old = {**rec, "conn": {k: v for k, v in conn.items() if k != "queue"}}  # a notice from before the queue stamp
    assert "forward_end_to_gpu" not in O.breakdown([old])
