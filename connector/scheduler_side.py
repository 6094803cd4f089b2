"""The connector's half that runs in vLLM's EngineCore process, beside the scheduler.

It sees finished requests (with their block ids and the sidecar's tag) and turns each into a
``PendingSave`` for the workers, shipped in the next step's metadata. It never touches
tensors, so it is plain Python and testable without vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from connector import protocol as P
from connector.worker_side import PendingSave

log = logging.getLogger("hsstream.connector")


class SchedulerSide:
    def __init__(self, spool_dir: str) -> None:
        self.spool_dir = spool_dir
        self._pending: list[PendingSave] = []

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Decide whether vLLM must keep the request's blocks until we have copied them.

        An aborted or incomplete request still produces a notice (status ``error``) so the
        sidecar can resubmit at once instead of waiting for a timeout.
        """
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None) or {}
        try:
            tag = P.tag_from_kv_params(params)
        except P.ProtocolError as e:
            log.error("request %s: %s", rid, e)
            tag = None
        tag_d = tag.model_dump(mode="json") if tag else None
        name = P.file_name_for_request(rid)
        if params.get("include_output_tokens"):
            # The last output token was never fed back through the model: no state for it.
            token_ids = list(request.all_token_ids)[:-1]
        else:
            token_ids = list(request.prompt_token_ids or [])
        computed = int(getattr(request, "num_computed_tokens", 0))
        error = None
        if not token_ids:
            error = "request has no prompt token ids (prompt embeddings are not supported)"
        elif not block_ids:
            error = "request finished before it was scheduled (aborted)"
        elif computed < len(token_ids):
            error = f"request finished after {computed} of {len(token_ids)} tokens (aborted mid-prefill)"
        if error is not None:
            self._pending.append(PendingSave(rid, name, [], [], tag_d, error=error))
            return False, None
        self._pending.append(PendingSave(rid, name, token_ids, list(block_ids), tag_d))
        return True, {P.KV_PARAMS_PATH_KEY: f"{self.spool_dir}/{name}", "hsstream_file": name}

    def take_pending(self) -> list[PendingSave]:
        out, self._pending = self._pending, []
        return out
