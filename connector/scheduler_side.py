"""The connector's half that runs in vLLM's EngineCore process, beside the scheduler.

It sees requests when they are first scheduled (to decide where each file goes, and to have
the worker take the file's lock before any client can see the path) and when they finish
(with their block ids and the sidecar's tag), turning each into a ``PendingSave`` for the
workers, shipped in the next step's metadata. A tag with an arena slot travels in the
``PendingSave``'s tag; its response names the slot (``KV_PARAMS_SLOT_KEY``), never a path. It never touches tensors, so it is plain
Python and testable without vLLM.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from connector import layouts as L
from connector.contract import messages as M, spool as SP
from connector.step_metadata import LockRequest, PendingSave

log = logging.getLogger("hsstream.connector")


@dataclass(frozen=True)
class _Target:
    path: str  # where the file goes
    custom: bool  # a client's own path, not the spool
    error: str | None = None  # refused: no file will be written


class SchedulerSide:
    def __init__(self, spool_dir: str, *, allow_custom_save_path: bool = False, use_lock: bool = True) -> None:
        self.spool_dir = spool_dir
        self.allow_custom_save_path = allow_custom_save_path
        self.use_lock = use_lock
        self._pending: list[PendingSave] = []
        self._targets: dict[str, _Target] = {}
        self._new_locks: dict[str, LockRequest] = {}

    def _target(self, request: Any) -> _Target:
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None) or {}
        custom = params.get(M.KV_PARAMS_PATH_KEY)
        default = f"{self.spool_dir}/{SP.file_name_for_request(rid)}"
        if custom is None:
            return _Target(default, False)
        if M.KV_PARAMS_KEY in params:
            return _Target(default, False, "the sidecar's requests are written to the spool, not to a custom path")
        if not self.allow_custom_save_path:
            return _Target(
                default, False,
                f"custom {M.KV_PARAMS_PATH_KEY} {str(custom)[:200]!r} refused: the connector's "
                "allow_custom_save_path is off (kv_connector_extra_config)",
            )  # fmt: skip
        if not isinstance(custom, str) or not custom.strip() or custom.endswith("/"):
            return _Target(default, False, f"custom {M.KV_PARAMS_PATH_KEY} {custom!r} is not a file path")
        return _Target(os.path.abspath(custom), True)

    def request_scheduled(self, request: Any) -> None:
        """First allocation of a request (``update_state_after_alloc``): fix its file and,
        for a plain client, have the worker hold ``<path>.lock`` from this step on."""
        rid = request.request_id
        if rid in self._targets:
            return  # resumed after a preemption
        t = self._target(request)
        self._targets[rid] = t
        if t.error is not None:
            log.error("request %s: %s", rid, t.error)
            return
        plain = M.KV_PARAMS_KEY not in (getattr(request, "kv_transfer_params", None) or {})
        if self.use_lock and plain:  # the sidecar's requests are announced by notices instead
            self._new_locks[rid] = LockRequest(t.path, make_dirs=t.custom)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Decide whether vLLM must keep the request's blocks until we have copied them.

        An aborted or incomplete request still produces a notice (status ``error``) so the
        sidecar can resubmit at once instead of waiting for a timeout, and releases its lock.
        """
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None) or {}
        try:
            tag = M.tag_from_kv_params(params)
        except M.ProtocolError as e:
            log.error("request %s: %s", rid, e)
            tag = None
        tag_d = tag.model_dump(mode="json") if tag else None
        target = self._targets.pop(rid, None)
        self._new_locks.pop(rid, None)  # finished before the worker ever saw it
        name = SP.file_name_for_request(rid)
        if params.get("include_output_tokens"):
            # The last output token was never fed back through the model: no state for it.
            token_ids = list(request.all_token_ids)[:-1]
        else:
            token_ids = list(request.prompt_token_ids or [])
        computed = int(getattr(request, "num_computed_tokens", 0))
        error = None
        if target is not None and target.error is not None:
            error = target.error
        elif not token_ids:
            error = "request has no prompt token ids (prompt embeddings are not supported)"
        elif not block_ids:
            error = "request finished before it was scheduled (aborted)"
        elif computed < len(token_ids):
            error = f"request finished after {computed} of {len(token_ids)} tokens (aborted mid-prefill)"
        elif getattr(getattr(request, "status", None), "name", "") == "FINISHED_ABORTED":
            # Its client is gone (disconnected, cancelled) and never gets the path: a file
            # written now would only sit in the spool.
            error = "request aborted before it finished (client gone)"
        if error is not None:
            self._pending.append(PendingSave(rid, name, [], [], tag_d, error=error))
            refused = target is not None and target.error is not None
            return False, ({M.KV_PARAMS_ERROR_KEY: error} if refused else None)
        if target is not None and target.custom:
            self._pending.append(PendingSave(rid, name, token_ids, list(block_ids), tag_d, path=target.path))
            return True, {M.KV_PARAMS_PATH_KEY: target.path}
        self._pending.append(PendingSave(rid, name, token_ids, list(block_ids), tag_d))
        # What the client is told of where the sample is, by its layout: the file's path, or (the
        # arena: no file will exist, so no path to one) the slot.
        return True, L.layout(L.of_sample(tag=tag, file=name)).writer_class().kv_params(tag, self.spool_dir, name)

    def take_pending(self) -> list[PendingSave]:
        out, self._pending = self._pending, []
        return out

    def take_new_locks(self) -> dict[str, LockRequest]:
        out, self._new_locks = self._new_locks, {}
        return out
