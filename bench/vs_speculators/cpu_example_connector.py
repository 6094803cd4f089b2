"""vLLM's ``ExampleHiddenStatesConnector`` (the connector speculators' offline data generation
reads), made to run on vLLM's CPU build without changing what it writes.

vLLM 0.32's Example connector is written for CUDA: found by running speculators' pipeline on
this machine's CPU build, a request's hidden states are never written:

1. ``_submit_async_write`` stages the states in ``torch.empty_like(..., pin_memory=True)``:
   RuntimeError "pin_memory=True requires a CUDA or other accelerator backend" (vLLM's CPU
   worker replaces ``Tensor.pin_memory`` with a no-op, not ``empty_like``'s argument);
2. ``get_finished`` then polls ``event.query()`` on the copy-done event, which on the CPU build
   is vLLM's ``_EventPlaceholder`` (``vllm/v1/worker/cpu/shm.py``): it has ``record``, ``wait``
   and ``synchronize`` but no ``query``.

This subclass runs the connector's own ``_submit_async_write`` (the same extraction from the
cache, the same tensors, file name, lock and writer threads), with the host buffer unpinned and
the copy-done event answering ``query()`` with True: on the CPU the copy is done when
``copy_`` returns. Everything else is the Example connector's. Loaded by vLLM through
``kv_connector_module_path`` (theirs.py's ``cpu_safe``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

class CpuExampleHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: Any) -> None:
        if torch.accelerator.is_available():
            return super()._submit_async_write(pending)
        real = torch.empty_like

        def empty_like(*a: Any, pin_memory: bool = False, **k: Any) -> torch.Tensor:  # noqa: ARG001 - no pinned memory on a CPU
            return real(*a, **k)

        torch.empty_like = empty_like  # the worker's one model thread calls this; restored at once
        try:
            super()._submit_async_write(pending)
        finally:
            torch.empty_like = real
        ev = self._req_copy_events.get(pending.req_id)
        if ev is not None and not hasattr(ev, "query"):
            ev.query = lambda: True  # CPU copy_: complete on return
        return None

