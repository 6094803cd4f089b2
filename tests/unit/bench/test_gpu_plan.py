"""docs/gpu-plan.md's scripts, the parts that run without a GPU: carrying a folder in parts
(checked, refused when incomplete or changed), and the real-model run's checks and commands
(every `hsstream up` / `train` / `eval` flag it uses parsed by our CLI, so a renamed flag
breaks here, not on the device)."""

from __future__ import annotations

import json

import pytest

from bench.gpu_plan import carry as C
from bench.gpu_plan import real_model as RM


def test_a_folder_goes_in_parts_and_comes_back_the_same(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "weights.bin").write_bytes(bytes(range(256)) * 9000)  # ~2.2 MiB
    m = C.pack(src, tmp_path / "parts", "m", part_mib=1)
    assert len(m["parts"]) == 3 and all(p["bytes"] <= 1 << 20 for p in m["parts"])
    calls = C.calls(tmp_path / "parts", "m")
    assert len(calls) == 3 and calls[0]["carry"][1].endswith("m.manifest.json")
    assert all("/root/stash" in c["command"] for c in calls)
    got = C.unpack(tmp_path / "parts", "m", tmp_path / "out")
    assert (got / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()


def test_a_missing_or_changed_part_is_refused_before_anything_is_extracted(tmp_path, capsys):
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(b"x" * (3 << 20))
    C.pack(src, tmp_path / "parts", "m", part_mib=1)
    part = tmp_path / "parts" / "m.tar.part01"
    data = part.read_bytes()
    part.write_bytes(data[:-1] + b"y")
    with pytest.raises(SystemExit) as e:
        C.unpack(tmp_path / "parts", "m", tmp_path / "out")
    assert e.value.code == 4 and "STASH_CORRUPT: m.tar.part01" in capsys.readouterr().out
    part.unlink()
    with pytest.raises(SystemExit) as e:
        C.unpack(tmp_path / "parts", "m", tmp_path / "out")
    assert e.value.code == 3 and "STASH_INCOMPLETE" in capsys.readouterr().out
    assert not (tmp_path / "out" / "m").exists()


def test_the_real_model_runs_commands_parse_and_its_data_is_checked(tmp_path, tiny_model, capsys):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}?"}, {"from": "gpt", "value": "a."}]}
            for i in range(30)]  # fmt: skip
    (tmp_path / "sg.json").write_text(json.dumps(rows))
    assert RM.make_data(tmp_path / "sg.json", tmp_path / "sg.jsonl", 25) == 25
    base = ["--model", tiny_model, "--data", str(tmp_path / "sg.jsonl"), "--train-samples", "20",
            "--workdir", str(tmp_path / "wd"), "--dry-run"]  # fmt: skip
    assert RM.main([*base, "--eval-prompts", "5", "--draft", "dflash", "--mask-token-id", "3"]) == 0
    out = capsys.readouterr().out
    assert "--submit-preset sharegpt --submit-limit 20 --draft dflash" in out and "--mask-token-id 3" in out
    assert "eval_untrained:" in out and "--no-baseline" in out
    with pytest.raises(SystemExit, match="5 held-out prompts after 20 trained, 6 asked"):
        RM.main([*base, "--eval-prompts", "6"])
    with pytest.raises(SystemExit, match="--draft nope"):
        RM.main([*base, "--eval-prompts", "5", "--draft", "nope"])


def test_parts_of_given_sizes_compressed_come_back_the_same(tmp_path):
    """--part-mib 1,2 (the last size repeats) and --compress xz: small parts ride with the bundle's."""
    import random

    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "noise.bin").write_bytes(random.Random(0).randbytes(3 << 20))  # does not compress: 3 MiB of parts
    m = C.pack(src, tmp_path / "parts", "m", part_mib="1,2", compress="xz")
    assert [p["bytes"] for p in m["parts"][:2]] == [1 << 20, 2 << 20] and len(m["parts"]) == 3 and m["compress"] == "xz"
    assert all(p["bytes"] <= 2 << 20 for p in m["parts"]) and sum(p["bytes"] for p in m["parts"]) == m["tar_bytes"]
    got = C.unpack(tmp_path / "parts", "m", tmp_path / "out")
    assert (got / "noise.bin").read_bytes() == (src / "noise.bin").read_bytes()
    with pytest.raises(SystemExit, match="each 1..59"):
        C.pack(src, tmp_path / "parts", "m", part_mib="13.6,60")


def test_a_cut_run_serves_its_newest_checkpoint_and_reports_the_trainers_last_figures(tmp_path):
    run = tmp_path / "run"
    assert RM.trained_draft(run) == (None, None) and RM.trainer_figures(run) is None
    for step in (10, 20):
        d = run / "checkpoints" / f"step-{step:08d}"
        (d / "draft").mkdir(parents=True)
        (d / "draft" / "config.json").write_text("{}")
        (d / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "step-00000030" / "draft").mkdir(parents=True)  # incomplete: no state, no config
    assert RM.trained_draft(run) == (run / "checkpoints" / "step-00000020" / "draft", 20)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "samples_per_s": 1.0}) + "\n" + json.dumps(
        {"step": 25, "samples_per_s": 9.5, "wait_frac": 0.25, "loss": 2.0, "top1_0": 0.5, "top1_1": 0.25}) + "\n")  # fmt: skip
    f = RM.trainer_figures(run)
    assert (f["steps"], f["samples_per_s"], f["wait_frac"], f["top1"], f["from"]) == (25, 9.5, 0.25, [0.5, 0.25], "metrics.jsonl")
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    (run / "result.json").write_text(json.dumps({"samples": 30, "steps": 30, "wall_s": 10.0, "wait_s": 1.0}))
    assert RM.trained_draft(run) == (run / "final", None)
    f = RM.trainer_figures(run)
    assert (f["samples_per_s"], f["wait_frac"], f["from"]) == (3.0, 0.1, "result.json")


def test_per_temperature_takes_vllms_counters_where_this_vllm_keeps_no_request_records():
    tps = {"with_draft": 50.0, "without_draft": 40.0}
    ev = {"temperatures": {
        "0.0": {"ours": {"mean_acceptance_length": 2.5, "acceptance_per_position": [0.9]},
                "vllm_metrics": {"mean_acceptance_length": 2.4}, "tokens_per_s": tps},
        "1.0": {"ours": None, "vllm_metrics": {"mean_acceptance_length": 1.7, "acceptance_per_position": [0.5]},
                "tokens_per_s": tps}}}  # fmt: skip
    got = RM.per_temperature(ev)
    assert (got["0.0"]["mean_acceptance_length"], got["0.0"]["mal_from"]) == (2.5, "requests")
    assert (got["1.0"]["mean_acceptance_length"], got["1.0"]["mal_from"]) == (1.7, "vllm_counters")
    assert got["1.0"]["acceptance_per_position"] == [0.5] and got["1.0"]["baseline_tokens_per_s"] == 40.0
    res = {"draft": "eagle3", "complete": True, "trained": got, "untrained": got, "trainer": {"steps": 3},
           "checks": {"t0_mal_trained_ge_untrained_plus_0.5": False}}  # fmt: skip
    table = RM.summary(res)
    assert " 1.0    trained             1.700       50.0" in table and "check t0_mal_trained_ge_untrained_plus_0.5: FAIL" in table


def test_stop_up_ends_a_child_that_ignores_sigterm_and_its_own_session_children(tmp_path):
    """What a cut `hsstream up` leaves if it hangs: a grandchild in its own session (as up starts
    vLLM and the sidecar), which the up process group does not hold."""
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "grandchild.pid"
    code = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            f"open({str(pidfile)!r}, 'w').write(str(g.pid)); time.sleep(60)")  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    g = int(pidfile.read_text())
    assert RM.stop_up(p, grace_s=0.5) is False and p.returncode is not None
    for _ in range(100):  # the grandchild is reaped by init once killed
        try:
            os_stat = open(f"/proc/{g}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if os_stat == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"grandchild {g} still running")


def test_an_eval_only_call_serves_the_earlier_calls_draft_and_reuses_its_untrained_arm(tmp_path, tiny_model, monkeypatch):
    """The GPU plan's two-call shape (docs/gpu-plan.md, stop 49): a call that trained to its deadline,
    then ``--eval-only`` on the same workdir: no ``hsstream up``, the newest checkpoint served, and
    with ``--untrained-from`` one engine only (the untrained arm and the baseline from that JSON)."""
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}?"}, {"from": "gpt", "value": "a."}]}
            for i in range(30)]  # fmt: skip
    (tmp_path / "sg.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ck = tmp_path / "wd" / "eagle3" / "run" / "checkpoints" / "step-00000040"
    (ck / "draft").mkdir(parents=True)
    (ck / "draft" / "config.json").write_text("{}")
    (ck / "trainer_state.pt").write_bytes(b"")
    fig = {"mean_acceptance_length": 1.0, "mal_from": "vllm_counters", "tokens_per_s": 500.0, "baseline_tokens_per_s": None}
    earlier = tmp_path / "r2.json"
    earlier.write_text(json.dumps({"untrained": {"0.0": fig}, "trained": {"0.0": {**fig, "baseline_tokens_per_s": 600.0}}}))
    ran = []
    monkeypatch.setattr(RM.subprocess, "Popen", lambda *a, **k: pytest.fail("no hsstream up in an --eval-only call"))
    monkeypatch.setattr(RM, "untrained_draft", lambda *a: None)

    def fake_run(argv, **kw):
        ran.append(argv)
        out = {"temperatures": {"0.0": {"ours": None, "vllm_metrics": {"mean_acceptance_length": 1.7},
                                        "tokens_per_s": {"with_draft": 700.0, "without_draft": None}}}}  # fmt: skip
        return RM.subprocess.CompletedProcess(argv, 0, json.dumps(out), "")

    monkeypatch.setattr(RM.subprocess, "run", fake_run)
    monkeypatch.setattr(RM, "ROOT", tmp_path)  # results land under tmp_path/bench/results
    rc = RM.main(["--model", tiny_model, "--data", str(tmp_path / "sg.jsonl"), "--train-samples", "20",
                  "--eval-prompts", "5", "--workdir", str(tmp_path / "wd"), "--eval-only",
                  "--untrained-from", str(earlier), "--name", "t"])  # fmt: skip
    res = json.loads((tmp_path / "bench" / "results" / "t.json").read_text())
    assert len(ran) == 1 and "--no-baseline" in ran[0] and str(ck / "draft") in ran[0]  # the trained arm only
    assert res["eval_only"] and res["trained_draft"] == {"dir": str(ck / "draft"), "checkpoint_step": 40}
    assert res["untrained"] == {"0.0": fig} and res["baseline_from"] == {"0.0": 600.0}
    assert res["trained"]["0.0"]["mean_acceptance_length"] == 1.7 and res["checks"] == {
        "t0_mal_trained_ge_untrained_plus_0.5": True} and rc == 0  # fmt: skip
