"""What the scheduler side tells the worker side each step, inside vLLM's connector metadata
(``vllm_plugin.StreamConnectorMetadata``, pickled from the EngineCore to every worker): the
saves to make and the locks to take. Plain dataclasses, so the pickle stays small and both
sides import it without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.contract import messages as M


@dataclass
class PendingSave:
    """Scheduler → worker, in the step's connector metadata (pickled: keep it plain)."""

    request_id: str
    file: str
    token_ids: list[int]
    block_ids: list[int]
    tag: dict | None = None  # RequestTag as JSON-able dict (an arena slot in its "slot": file unused)
    error: str | None = None  # set: send an error notice, there is nothing to copy
    path: str | None = None  # a client's own path (allow_custom_save_path); None: spool / file

    def request_tag(self) -> M.RequestTag | None:
        return M.RequestTag.model_validate(self.tag) if self.tag else None


@dataclass(frozen=True)
class LockRequest:
    """Scheduler → worker: hold ``<data_path>.lock`` for a request scheduled this step."""

    data_path: str
    make_dirs: bool = False  # a custom path's directory may not exist yet (as the Example connector)
