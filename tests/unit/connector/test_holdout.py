"""connector/contract/holdout.py: the held-out split trainer and evaluator share."""

from __future__ import annotations

import math

import pytest

from connector.contract.holdout import check_fraction, held_out, sample_identity


def test_the_split_is_deterministic_about_the_fraction_and_drawn_anew_by_another_seed():
    ids = [f"id-{i}" for i in range(20_000)]
    a = {i for i in ids if held_out(i, 0.1, seed=0)}
    assert a == {i for i in ids if held_out(i, 0.1, seed=0)}  # the same every time
    assert abs(len(a) - 2_000) < 4 * math.sqrt(20_000 * 0.1 * 0.9), len(a)  # ~10 %, within 4 sigma
    b = {i for i in ids if held_out(i, 0.1, seed=1)}
    assert abs(len(b) - 2_000) < 4 * math.sqrt(1_800) and abs(len(a & b) - 200) < 4 * math.sqrt(200), len(a & b)
    bigger = {i for i in ids if held_out(i, 0.2, seed=0)}
    assert a < bigger  # a larger fraction holds out what the smaller one did, and more
    assert not any(held_out(i, 0.0) for i in ids[:1000])


def test_identity_is_the_rows_id_else_its_index():
    assert sample_identity("conv-17", 3) == "conv-17" and sample_identity(None, 3) == "#3"
    assert sample_identity("#3", 9) == "#3"  # a row may name itself so: the same identity, by design of ids


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan")])
def test_fractions_outside_0_1_are_refused(bad):
    with pytest.raises(ValueError, match="eval fraction"):
        check_fraction(bad)
    assert check_fraction(0.0) == 0.0 and check_fraction(0.5) == 0.5
