"""A sample's states and the moves between them: the ledger's state machine as a table.

Every write of a sample (:meth:`Ledger._save <server.ledger.core.LedgerCore._save>`) checks
its move against :data:`TRANSITIONS` first, so a move the table does not name is a bug that
stops the call, never a state written to disk.
"""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    queued = "queued"
    submitted = "submitted"
    ready = "ready"
    leased = "leased"
    consumed = "consumed"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = frozenset({State.consumed, State.failed, State.cancelled})
IN_FLIGHT = (State.submitted, State.ready, State.leased)

_S = State
#: Each state's possible next states, and who makes each move. Any state not terminal may end
#: FAILED (``fail``), CANCELLED (``cancel_job``) or CONSUMED: an ack with the token of the
#: sample's latest lease counts once, also when the lease lapsed or the sidecar restarted and
#: the sample is READY or QUEUED again (``ack``).
TRANSITIONS: dict[State, frozenset[State]] = {
    # next_to_submit; fail_queued (a limit learned after admission)
    _S.queued: frozenset({_S.submitted, _S.failed, _S.cancelled, _S.consumed}),
    # on_notice / set_generated → READY; requeue, a busy or failed notice, recover → QUEUED
    _S.submitted: frozenset({_S.queued, _S.ready, _S.failed, _S.cancelled, _S.consumed}),
    # lease_next / lease_many → LEASED; file_lost, recover → QUEUED
    _S.ready: frozenset({_S.leased, _S.queued, _S.failed, _S.cancelled, _S.consumed}),
    # release_owner, unlease, recover → READY (file there) or QUEUED; trainer_failed → QUEUED or FAILED
    _S.leased: frozenset({_S.ready, _S.queued, _S.failed, _S.cancelled, _S.consumed}),
    _S.consumed: frozenset(),
    _S.failed: frozenset(),
    _S.cancelled: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move :data:`TRANSITIONS` does not allow: a bug in the ledger, not a peer's doing."""


def check_transition(old: State | None, new: State) -> None:
    """Raise unless ``old`` → ``new`` is in the table (``old`` None: a sample not yet written,
    which only enters QUEUED). Staying in a state is always allowed (a write of other fields)."""
    if old == new or (old is None and new == State.queued) or (old is not None and new in TRANSITIONS[old]):
        return
    raise IllegalTransition(f"a sample cannot go from {old.value if old else 'nothing'} to {new.value}")


class NoticeOutcome(Enum):
    """What :meth:`Ledger.on_notice <server.ledger.submission.Submission.on_notice>` made of a
    connector notice, and so what becomes of its file."""

    #: Its sample is READY now: the file is kept and a trainer may take it (wake the delivery thread).
    ready = "ready"
    #: Its sample keeps the file but is not READY: a repeat of a notice already applied, or in
    #: regenerate mode a file that waits for vLLM's reply.
    held = "held"
    #: No sample wants the file (unknown key, cancelled, an older attempt, a busy or failed
    #: connector): the caller deletes it.
    refused = "refused"

    @property
    def keeps_file(self) -> bool:
        return self is not NoticeOutcome.refused
