"""bench/costs/fp8_gather_cost.py's CPU smoke: the same code as on the GPU, on CPU tensors, so the
GPU call does not find its bugs; and its byte comparison is a real one."""

from __future__ import annotations

import json

import torch

from bench.costs import fp8_gather_cost as F


def test_the_cpu_smoke_runs_both_arms_and_finds_their_bytes_equal(tmp_path):
    out = tmp_path / "fp8.json"
    assert F.main(["--cpu-smoke", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bytes_equal"] is True and r["bytes_equal_rounds"] == r["rounds"]
    t, k, h = r["shape"]["tokens"], r["shape"]["layers"], r["shape"]["hidden"]
    assert r["arms"]["host"]["d2h_bytes"] == t * k * h * 2  # bf16 rows
    assert r["arms"]["device"]["d2h_bytes"] == t * k * h + 4 * t  # FP8 values + one float32 scale per token
    assert all(r["arms"][a]["n"] == r["rounds"] for a in F.ARMS)


def test_one_flipped_byte_of_the_device_arm_makes_bytes_equal_false(tmp_path, monkeypatch):
    real = F.one

    def flipped(arm, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        dt, enc, moved, landed = real(arm, *a, **kw)
        if arm == "device":
            enc["hidden_states"].view(torch.uint8).view(-1)[7] ^= 1
        return dt, enc, moved, landed

    monkeypatch.setattr(F, "one", flipped)
    out = tmp_path / "fp8.json"
    assert F.main(["--cpu-smoke", "--out", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["bytes_equal"] is False and r["bytes_equal_rounds"] == 0
