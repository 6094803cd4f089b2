"""``epoch_seed``: the sampling seed each epoch of a regenerate job uses (the integration test:
tests/integration/server/test_reliability.py, fresh replies at T=1 from real vLLM)."""

from __future__ import annotations

from server.submitter import epoch_seed


def test_epoch_seed_keeps_epoch_0s_and_gives_each_later_epoch_its_own_in_int64():
    assert epoch_seed(123, 0) == 123 and epoch_seed(-5, 0) == -5
    seeds = [epoch_seed(123, e) for e in range(1, 200)]
    assert len(set(seeds + [123])) == 200 and all(0 <= x < 2**63 for x in seeds)
    assert epoch_seed(2**63 - 1, 3) == epoch_seed(2**63 - 1, 3) and 0 <= epoch_seed(-(2**63), 1) < 2**63
