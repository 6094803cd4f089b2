"""bench/long_checks/vllm_conformance.py (``make vllm-conformance``) on the vLLM installed here (0.32, the CPU
build: the same Python as the CUDA wheel), read from its source as the target reads each wheel:
it passes, and fails on a planted signature mismatch, a missing hook, a drifted hook order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.long_checks import vllm_conformance as C
from connector.contract import vllm_hooks as H

vllm = pytest.importorskip("vllm")
ROOT = Path(vllm.__file__).resolve().parent.parent  # site-packages: ROOT/vllm/...
VERSION = C.source_version(ROOT)


def failed(result: dict | list) -> dict[str, object]:
    checks = result["checks"] if isinstance(result, dict) else result
    return {c["check"]: c["detail"] for c in checks if not c["ok"]}


def test_the_installed_vllm_conforms_and_the_hook_order_test_drives_its_order():
    r = C.check_version(ROOT, VERSION, by_import=False)
    assert r["ok"], failed(r)
    orders = {c["check"]: c["detail"]["steps"] for c in r["checks"] if c["check"].startswith("hook_order:v")}
    assert orders == {f"hook_order:{x.name}": {p: H.step(x, p) for p in x.paths} for x in H.RUNNERS
                      if VERSION in x.versions}  # fmt: skip


def test_a_planted_signature_mismatch_or_missing_hook_fails(tmp_path):
    src = C.PLUGIN.read_text()
    bad = tmp_path / "plugin.py"
    planted = src.replace("def get_finished(self, finished_req_ids: set[str])", "def get_finished(self)", 1)
    assert planted != src
    bad.write_text(planted)
    f = failed(C.check_signatures(ROOT, bad))
    assert "argument 1" in f["overrides"]["failures"]["get_finished"], f
    planted = src.replace("    def wait_for_layer_load(self, layer_name: str) -> None:\n        pass\n", "", 1)
    assert planted != src
    bad.write_text(planted)
    f = failed(C.check_signatures(ROOT, bad))
    assert f["abstract_methods"]["failures"] == {"wait_for_layer_load": "not implemented"}, f
    planted = src.replace("    @classmethod\n    def get_required_kvcache_layout", "    @staticmethod\n    def get_required_kvcache_layout", 1)
    bad.write_text(planted)
    assert "is a staticmethod, vLLM's a classmethod" in \
        failed(C.check_signatures(ROOT, bad))["overrides"]["failures"]["get_required_kvcache_layout"]  # fmt: skip


def test_a_hook_order_that_drifted_from_vllms_source_fails(monkeypatch):
    """The data the hook-order test drives, changed (wait_for_save moved before get_finished in
    V1's finalize), no longer reads as vLLM's source: the target fails."""
    fn = H.V1.fn("KVConnectorModelRunnerMixin._get_kv_connector_output")
    calls = list(fn.calls)
    i = next(k for k, c in enumerate(calls) if c.name == "kv_connector.wait_for_save")
    calls.insert(i - 2, calls.pop(i))
    drifted = dataclasses.replace(H.V1, fns=tuple(dataclasses.replace(f, calls=tuple(calls)) if f is fn else f
                                                  for f in H.V1.fns))  # fmt: skip
    monkeypatch.setattr(H, "RUNNERS", (drifted, *H.RUNNERS[1:]))
    f = failed(C.check_hook_order(ROOT, VERSION, C.PLUGIN))
    assert "KVConnectorModelRunnerMixin._get_kv_connector_output" in f["hook_order:v1"]["differences"], f


@pytest.mark.parametrize("ours, base, why", [
    ("def f(self, a, b=1): ...", "def f(self, a): ...", None),
    ("def f(self, *args, **kwargs): ...", "def f(self, a, b, **kw): ...", None),
    ("def f(self, a): ...", "def f(self, a, b): ...", "takes no argument 2 ('b')"),
    ("def f(self, x): ...", "def f(self, a): ...", "argument 1 is 'x', vLLM's 'a'"),
    ("def f(self, a, c): ...", "def f(self, a): ...", "requires argument 'c'"),
    ("def f(self, a): ...", "def f(self, a, **kw): ...", "takes no **kwargs"),
    ("def f(self, a, *, k=1): ...", "def f(self, a, *, k): ...", None),
])  # fmt: skip
def test_compatible_accepts_every_call_the_base_allows_and_nothing_less(ours, base, why):
    import ast

    def sig(text: str) -> C.Sig:
        return C.signature(ast.parse(text).body[0])

    got = C.compatible(sig(ours), sig(base))
    assert (got is None) if why is None else (got is not None and why in got), got
