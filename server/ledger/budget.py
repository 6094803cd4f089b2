"""What the spool may still take: the bytes the ledger holds against ``HSSTREAM_SPOOL_BUDGET_BYTES``
and the limit on READY samples, with their watermarks.

``reserved`` is the expected bytes of every SUBMITTED sample without a file yet plus the real
bytes of every file in the spool that a sample still holds; the ledger's moves keep it (under
its lock). Submission stops when a sample would take ``reserved`` past the budget, or when
``max_ready`` samples wait for a trainer, and resumes only once usage has fallen to
``low_water`` of the limit, so vLLM gets batches rather than a trickle of one request per
consumed sample.
"""

from __future__ import annotations


class SpoolBudget:
    def __init__(self) -> None:
        self.reserved = 0  # bytes, see the module's docstring
        self.throttled = False  # a limit was hit: wait for the low watermark

    def closed(self, n_ready: int, budget: int, max_ready: int | None, low_water: float, pinned: int = 0) -> bool:
        """Whether submission waits, before any sample is looked at: throttled and still above
        a low watermark, or ``max_ready`` reached (which throttles). ``pinned``: bytes trainers
        hold at or over their share of the budget (``server/delivery.py``): no amount of waiting
        frees them, so the watermark is of the rest (else a trainer pinning more than the low
        watermark would stop production for everyone)."""
        if self.throttled:
            rest, room = self.reserved - pinned, budget - pinned
            if rest > low_water * room or (max_ready is not None and n_ready > low_water * max_ready):
                return True
            self.throttled = False
        if max_ready is not None and n_ready >= max_ready:
            self.throttled = True
            return True
        return False

    def fits(self, expected_bytes: int, budget: int) -> bool:
        """Whether a sample of ``expected_bytes`` may be submitted now; if not, throttled. One
        sample always fits an empty spool, so a sample larger than the budget is not stuck."""
        if self.reserved + expected_bytes > budget and self.reserved > 0:
            self.throttled = True
            return False
        return True
