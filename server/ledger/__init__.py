"""Every sample's state: the single source of truth for "nothing lost, nothing counted twice".

QUEUED → SUBMITTED → READY → LEASED → CONSUMED, or FAILED / CANCELLED. The submitter, the
notice thread and the delivery thread all move samples through one :class:`Ledger` under one
lock, each move checked against the current state and attempt. Every move is written through
to SQLite (WAL) before the lock is released, so a sidecar killed at any moment restarts from a
state it had really reached; a thread with several moves at hand applies them in one
``Ledger.group()`` (one commit, the lock held until it is on disk). Memory is O(in flight):
SQLite holds every sample and the queue; only SUBMITTED / READY / LEASED samples are objects in
RAM, bounded by the spool budget, ``max_ready`` and the submit concurrency.

Where each part is (``Ledger`` combines them; each module reads on its own):

================================  ===========================================================
``states.py``                     ``State``, the transition table ``TRANSITIONS`` (checked at
                                  every write), ``NoticeOutcome`` (what a notice's file becomes)
``rows.py``                       ``SampleRow`` (one sample), ``Job`` (its counters),
                                  ``NewSample`` (a sample being admitted)
``store.py``                      the SQLite file: private creation, schema, ``SCHEMA_VERSION``
                                  and the ordered ``_MIGRATIONS``, transactions, row codec
``budget.py``                     ``SpoolBudget``: reserved spool bytes and the watermarks
``core.py``                       the shared state and lock, writing a sample through
                                  (``_save``), the moves every side uses, ``recover``
``jobs.py``                       ``begin_job`` → ``JobWriter`` (samples staged a batch at a
                                  time, then queued whole), ``add_job``, ``cancel_job``,
                                  ``compact`` (all chunked)
``submission.py``                 vLLM side: ``next_to_submit``, ``requeue``, ``on_notice``,
                                  ``set_generated``, timeouts
``leases.py``                     trainer side: ``lease_many``, ``holds``, ``received``,
                                  ``ack_many``, ``trainer_failed``, ``release_owner``
``read_models.py``                counts and pages for REST and metrics; ``snapshot()``
``facade.py``                     ``Ledger`` itself
================================  ===========================================================

Who hears a move: ``Ledger.listeners`` (the metrics, the submitter's SUBMITTED count), on the
thread that made it. The ledger wakes no thread itself: the notices thread and the submitter
ring the delivery thread's doorbell when they made samples READY (wired in ``server/app.py``).
"""

from server.ledger.budget import SpoolBudget
from server.ledger.core import ADMITTING, GROUP_MAX, Listener
from server.ledger.facade import Ledger
from server.ledger.jobs import ADD_BATCH, JobWriter
from server.ledger.read_models import JobFigures, Snapshot
from server.ledger.rows import Job, NewSample, SampleRow
from server.ledger.states import IN_FLIGHT, TERMINAL, TRANSITIONS, IllegalTransition, NoticeOutcome, State
from server.ledger.store import SCHEMA_VERSION

__all__ = [
    "ADD_BATCH", "ADMITTING", "GROUP_MAX", "IN_FLIGHT", "SCHEMA_VERSION", "TERMINAL", "TRANSITIONS", "IllegalTransition", "Job", "JobWriter",
    "JobFigures", "Ledger", "Listener", "NewSample", "NoticeOutcome", "SampleRow", "Snapshot", "SpoolBudget", "State",
]  # fmt: skip
