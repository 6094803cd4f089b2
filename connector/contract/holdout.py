"""Which samples of a job are held out for evaluation: one rule, shared by trainer and evaluator.

``hsstream train --eval-fraction F`` never trains on the samples this rule holds out, and
``hsstream eval --job ID --eval-fraction F`` measures acceptance on exactly those, so the two
must agree without talking to each other, in any order the stream delivers, on every rank and
in every epoch (also when a regenerated reply changes a sample's tokens). The rule therefore
reads only what both sides see and what never changes: the sample's identity in its job (the
user's ``id`` when the row has one, else its position in the job, ``#<index>``) and a seed. A
keyed hash of the two, read as a number in [0, 1), is below ``fraction`` for a held-out sample:
the same inputs always give the same split, about ``fraction`` of any job is held out, and
another seed draws another split.
"""

from __future__ import annotations

import hashlib

__all__ = ["held_out", "sample_identity", "check_fraction"]


def sample_identity(label: str | None, index: int) -> str:
    """What the split is drawn on: the row's own ``id``, else its index in the job."""
    return label if label is not None else f"#{index}"


def check_fraction(fraction: float) -> float:
    if not 0.0 <= fraction < 1.0:  # also refuses NaN
        raise ValueError(f"eval fraction must be in [0, 1), got {fraction!r}")
    return float(fraction)


def held_out(identity: str, fraction: float, seed: int = 0) -> bool:
    """True for a sample held out of training (and evaluated on)."""
    if fraction <= 0.0:
        return False
    h = hashlib.blake2b(identity.encode("utf-8", "surrogatepass"), digest_size=8, key=str(int(seed)).encode())
    return int.from_bytes(h.digest(), "big") / 2.0**64 < fraction
