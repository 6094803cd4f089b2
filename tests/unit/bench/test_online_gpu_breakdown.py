"""bench/online_gpu.py's latency breakdown: the sidecar's hop split by the stamps it adds."""

from __future__ import annotations

import pytest

from bench import online_gpu as O


def test_the_sidecar_hop_is_split_by_its_stamps_and_the_connectors_stages_keep_their_prefix():
    rec = {"sent": 100.0, "conn": {"write": 0.014, "sidecar_in": 0.0005, "sidecar_queue": 0.0015},
           "stream": {"received": 100.0025, "started": 100.003, "checked": 100.010, "handed": 100.0102},
           "y": 100.0103, "g": 100.0104}  # fmt: skip
    b = O.breakdown([rec])
    assert b["connector_write"]["p50_ms"] == pytest.approx(14.0)
    assert b["sidecar"]["p50_ms"] == pytest.approx(2.5)
    assert b["sidecar_in"]["p50_ms"] == pytest.approx(0.5) and b["sidecar_queue"]["p50_ms"] == pytest.approx(1.5)
    assert b["sidecar_to_trainer"]["p50_ms"] == pytest.approx(0.5)  # what is left of the 2.5
    assert "connector_sidecar_in" not in b
    old = {**rec, "conn": {"write": 0.014}}  # a notice from before the stamps: no split, no error
    assert "sidecar_to_trainer" not in O.breakdown([old]) and "sidecar" in O.breakdown([old])
