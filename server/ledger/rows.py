"""The ledger's row types: a sample (:class:`SampleRow`), a job's counters (:class:`Job`) and a
sample being admitted (:class:`NewSample`).

A ``SampleRow`` is the ledger's record of one sample, not the tensors a trainer gets (that is
``trainer_client``'s ``Sample``).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from connector import protocol as P
from connector.contract.arena import Slot
from server.ledger.states import TERMINAL, State


@dataclass
class SampleRow:
    """One sample as an object: in flight (kept in RAM), or loaded from SQLite for one call."""

    key: P.SampleKey
    token_ids: list[int]
    loss_mask: list[int] | None
    label: str | None
    expected_bytes: int
    state: State = State.queued
    attempt: int = 0
    notice: P.Notice | None = None
    on_disk_bytes: int = 0  # file present in the spool (READY/LEASED until received)
    lease_owner: bytes | None = None
    #: The secret of the sample's latest lease (its DELIVER carried it): what proves a trainer
    #: held it. Kept, on disk too, until the next lease, so the trainer can still settle it
    #: after its lease lapsed or the sidecar restarted.
    lease_token: str | None = None
    submitted_at: float = 0.0
    errors: list[str] = field(default_factory=list)
    generated: bool = False  # regenerate mode: vLLM's reply is known (token ids final)
    prompt_len: int = -1  # regenerate mode: token_ids beyond this are vLLM's reply
    qpos: int = 0  # place in the queue while QUEUED
    saved: State | None = None  # the state SQLite holds (per-job counts follow it)
    #: The placement the spool layout reserved at submission (the arena's slot), held until its
    #: bytes are freed (``LedgerCore._save`` gives it back); None with files, or when the size
    #: was not known. On disk as opaque text (``samples.placement``, ``connector.layouts.encode_placement``).
    slot: Slot | None = None
    # The notice as JSON, made once per notice rather than at each of its transitions.
    _notice_json: tuple[P.Notice, str] | None = field(default=None, repr=False, compare=False)

    def notice_json(self) -> str | None:
        if self.notice is None:
            return None
        if self._notice_json is None or self._notice_json[0] is not self.notice:
            self._notice_json = (self.notice, self.notice.model_dump_json())
        return self._notice_json[1]


@dataclass
class Job:
    """A job's counters, kept incrementally so status, metrics and the delivery thread's
    completion check are O(1) per job, whatever its size."""

    job_id: str
    num_samples: int = 0
    created: float = field(default_factory=time.time)
    finished: float | None = None
    tokens_consumed: int = 0
    bytes_consumed: int = 0
    sampling: dict | None = None  # regenerate mode: vLLM writes the reply with these
    state_counts: Counter = field(default_factory=Counter, repr=False)
    n_errors: int = 0  # samples with at least one error
    compacted: bool = False  # rows deleted after the retention; the counts are a summary
    admitting: bool = False  # its rows are still being written (a batch at a time): not done whatever the counts
    cancelling: bool = False  # cancelled: its queued rows are being marked a chunk at a time; none is submitted

    def counts(self) -> dict[str, int]:
        return {st.value: self.state_counts.get(st.value, 0) for st in State}

    @property
    def n_terminal(self) -> int:
        return sum(self.state_counts.get(st.value, 0) for st in TERMINAL)

    @property
    def done(self) -> bool:
        return not self.admitting and self.n_terminal == self.num_samples


@dataclass
class NewSample:
    token_ids: list[int]
    loss_mask: list[int] | None
    label: str | None
    expected_bytes: int
