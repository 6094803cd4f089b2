"""The hybrid GPU check's verdict (``bench/online_gpu/gpu_check.py --family hybrid``): which outcome is
``pass``, ``fail``, ``error`` or ``unsupported``, and the error text it records. The engines
are not started here (the CPU smoke and the H200 run do that); the runs' results are written
as the vLLM step writes them, with small tensors standing in for the hidden states."""

from __future__ import annotations

import pytest
import torch

from bench.online_gpu import gpu_check as G

LAYERS = [9, 2, 12, 6]
#: What a failed engine start prints (trimmed from a vLLM log): the root cause, then wrappers.
ENGINE_LOG = [
    "(EngineCore pid=19989) ERROR 12-01 03:05:37 [core.py:1512] EngineCore encountered a fatal error.",
    "(EngineCore pid=19989) ERROR 12-01 03:05:37 [core.py:1512] Traceback (most recent call last):",
    "\x1b[1;36m(EngineCore pid=19989)\x1b[0m ERROR [kv_cache_utils.py:901] NotImplementedError: The page size of "
    "the layer is not divisible by the maximum page size",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
]


def _states(seed: int, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, len(LAYERS), 16, generator=g)  # layers differ from each other


def _run(tmp_path, tag: str, tensors: list[torch.Tensor], layers_in_file: list[int], ours: bool) -> dict:
    files = []
    for i, t in enumerate(tensors):
        p = tmp_path / f"{tag}-{i}.pt"
        torch.save(t, p)
        files.append({"tokens": t.shape[0], "tensor": str(p), "shape": list(t.shape), "ids_ok": True,
                      "header_layer_ids": layers_in_file if ours else None})  # fmt: skip
    run = {"files": files}
    if ours:
        run["exactly_once"] = {"ok": True}
    return run


def _ours_and_example(tmp_path, noise: float = 0.0):
    ours = [_states(1, 5), _states(2, 17)]
    perm = [sorted(LAYERS).index(i) for i in LAYERS]
    inv = [perm.index(j) for j in range(len(LAYERS))]  # ascending order, as the Example connector writes
    example = [(t + noise * t.abs().amax())[:, inv] for t in ours]
    return _run(tmp_path, "ours", ours, LAYERS, True), _run(tmp_path, "ex", example, sorted(LAYERS), False)


def _doc(**steps) -> dict:
    return {"steps": steps, "vllm": "0.26.0"}


def test_both_engines_fail_is_unsupported_with_the_example_connectors_error():
    err = G.StepFailed("step example_tp1 failed (exit code 1)", G.root_cause(ENGINE_LOG), ENGINE_LOG).record()
    doc = _doc(ours_tp1=dict(err, error="step ours_tp1 failed"), example_tp1=err)
    assert G.hybrid_verdict(doc, {}, None, LAYERS, 0.05, "none") == 0
    assert doc["status"] == "unsupported"
    assert "vLLM 0.26.0 cannot extract" in doc["reason"]
    assert "NotImplementedError: The page size of the layer is not divisible" in doc["reason"]


def test_a_time_out_is_never_read_as_unsupported():
    err = G.StepFailed("step example_tp1 did not finish within 60 s", [], [], timed_out=True).record()
    doc = _doc(ours_tp1=err, example_tp1=err)
    assert G.hybrid_verdict(doc, {}, None, LAYERS, 0.05, "none") == 1
    assert doc["status"] == "error"


def test_ours_failing_where_the_example_connector_works_is_our_error(tmp_path):
    _, ex = _ours_and_example(tmp_path)
    ours_err = G.StepFailed("step ours_tp1 failed", ["KeyError: 'x'"], []).record()
    doc = _doc(ours_tp1=ours_err, example_tp1={"vllm": "0.26.0"})
    assert G.hybrid_verdict(doc, {"example_tp1": ex}, None, LAYERS, 0.05, "none") == 1
    assert doc["status"] == "error"
    assert "KeyError: 'x'" in doc["reason"]


def test_ours_failing_without_the_example_connector_says_it_cannot_tell():
    doc = _doc(ours_tp1=G.StepFailed("step ours_tp1 failed", ["ValueError: boom"], []).record())
    assert G.hybrid_verdict(doc, {}, None, LAYERS, 0.05, "none") == 1
    assert doc["status"] == "error"
    assert "did not run" in doc["reason"] and "ValueError: boom" in doc["reason"]


def test_equal_to_the_example_connector_passes_and_its_control_is_caught(tmp_path):
    ours, ex = _ours_and_example(tmp_path)
    doc = _doc(ours_tp1={}, example_tp1={}, hf={"ok": False, "error": "HF cannot run it"})
    assert G.hybrid_verdict(doc, {"ours_tp1": ours, "example_tp1": ex}, None, LAYERS, 0.05, "none") == 0
    assert doc["status"] == "pass", doc
    assert all(r["equal"] and r["control_swapped_caught"] for r in doc["vs_example_connector"]["rows"])
    assert doc["ours_tp1"]["vs_hf"] == "HF could not run this model"


@pytest.mark.parametrize("how", ["swap-ref", "noise"])
def test_a_wrong_reference_fails(tmp_path, how):
    ours, ex = _ours_and_example(tmp_path, noise=0.2 if how == "noise" else 0.0)
    doc = _doc(ours_tp1={}, example_tp1={})
    inject = "swap-ref" if how == "swap-ref" else "none"
    assert G.hybrid_verdict(doc, {"ours_tp1": ours, "example_tp1": ex}, None, LAYERS, 0.05, inject) == 1
    assert doc["status"] == "fail"
    assert "vs_example" in doc["reason"]


def test_hf_reference_gates_when_it_ran(tmp_path):
    ours, ex = _ours_and_example(tmp_path)
    hf = {"files": [{"tokens": f["tokens"], "tensor": f["tensor"]} for f in ours["files"]]}
    doc = _doc(ours_tp1={}, example_tp1={}, hf={})
    assert G.hybrid_verdict(doc, {"ours_tp1": ours, "example_tp1": ex}, hf, LAYERS, 0.05, "none") == 0
    assert doc["checks"]["vs_hf"] and doc["checks"]["hf_control_caught"]
    doc = _doc(ours_tp1={}, example_tp1={}, hf={})
    assert G.hybrid_verdict(doc, {"ours_tp1": ours, "example_tp1": ex}, hf, LAYERS, 0.05, "swap-ref") == 1
    assert doc["checks"]["vs_hf"] is False


def test_hf_alone_gates_when_the_example_connector_did_not_run(tmp_path):
    ours, _ = _ours_and_example(tmp_path)
    hf = {"files": [{"tokens": f["tokens"], "tensor": f["tensor"]} for f in ours["files"]]}
    doc = _doc(ours_tp1={}, hf={})  # the CPU smoke: vLLM's CPU build cannot run the Example connector
    assert G.hybrid_verdict(doc, {"ours_tp1": ours}, hf, LAYERS, 0.05, "none") == 0
    assert doc["status"] == "pass" and doc["vs_example_connector"]["error"] == "not run"
    doc = _doc(ours_tp1={}, hf={})
    assert G.hybrid_verdict(doc, {"ours_tp1": ours}, hf, LAYERS, 0.05, "swap-ref") == 1
    assert doc["status"] == "fail"


def test_root_cause_prefers_the_specific_error_over_the_wrappers():
    assert G.root_cause(ENGINE_LOG) == [
        "NotImplementedError: The page size of the layer is not divisible by the maximum page size"
    ]
    assert G.root_cause(["RuntimeError: Engine core initialization failed. See root cause above."]) == [
        "RuntimeError: Engine core initialization failed. See root cause above."
    ]
    assert G.root_cause(["INFO all fine"]) == []
