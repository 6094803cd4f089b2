"""The :class:`Ledger`: one object, one lock, one SQLite file, made of the parts of this package."""

from __future__ import annotations

from server.ledger.jobs import Jobs
from server.ledger.leases import Leases
from server.ledger.read_models import ReadModels
from server.ledger.submission import Submission


class Ledger(Jobs, Submission, Leases, ReadModels):
    """Every sample's state: the single source of truth for "nothing lost, nothing counted twice".

    ``Ledger(path, max_attempts)``: ``path`` None keeps it in memory (tests); a sample fails
    for good after ``max_attempts`` errors. See the package's docstring for which part does what.
    """
