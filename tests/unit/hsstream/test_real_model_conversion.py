"""`hsstream models get smollm2`'s checkpoint is the GGUF model: its conversion check passed
within the stated tolerances, the checkpoint gives the reference logits kept at conversion again,
and the check fails on a checkpoint with one weight perturbed by 0.5 %."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hsstream import gguf_convert as G


def test_the_conversion_report_passed_within_its_tolerances(smollm2):
    r = json.loads((Path(smollm2) / G.CHECK_DIR / "report.json").read_text())
    assert r["passed"] and not r["problems"] and "Paris" in r["greedy_answer"]
    assert r["tolerances"] == {"exact_rel": G.EXACT_TOL, "drift_rel": G.DRIFT_TOL, "drift_top1": G.DRIFT_TOP1}
    assert all(e["rel"] <= G.EXACT_TOL and e["top1_agreement"] == 1.0 for e in r["exact_vs_bf16_rounded_gguf"])
    assert all(d["rel"] <= G.DRIFT_TOL for d in r["drift_vs_float32_gguf"])
    cfg = json.loads((Path(smollm2) / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], cfg["dtype"]) == (30, 576, 49152, "bfloat16")
    tok_cfg = Path(smollm2) / "chat_template.jinja"
    assert "<|im_start|>" in tok_cfg.read_text()


def test_the_check_fails_on_a_perturbed_weight(smollm2, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    assert G.recheck(Path(smollm2))["exact_vs_bf16_rounded_gguf"]
    bad = tmp_path / "perturbed"
    bad.mkdir()
    for f in os.listdir(smollm2):
        if f != "model.safetensors":
            os.symlink(Path(smollm2) / f, bad / f)
    w = load_file(Path(smollm2) / "model.safetensors")
    name = "model.layers.10.mlp.down_proj.weight"
    w[name] = (w[name].float() * 1.005).to(torch.bfloat16)
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(G.ConversionCheckFailed, match="does not give the logits kept at its conversion"):
        G.recheck(bad)
