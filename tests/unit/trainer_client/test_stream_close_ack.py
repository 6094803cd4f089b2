"""``ack="use"`` acknowledges a sample when the loop asks for the next one. A loop that breaks
out has not asked past the sample it was given last, so close() must not ack it: the lease goes
back and the sample is produced again (trained twice at worst, never lost unused). Samples the
loop asked past are acked, on close() too."""

from __future__ import annotations

import time

from connector import protocol as P
from tests.unit.trainer_client.test_stream_pool import FakeSidecar, write_sample
from trainer_client import HiddenStateStream


def _run(tmp_path, n: int, take: int, **kw) -> tuple[FakeSidecar, list]:
    spool = tmp_path / "spool"
    spool.mkdir()
    ds = [write_sample(spool, i) for i in range(n)]
    sc = FakeSidecar(tmp_path, ds, end=False)
    got = []
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=spool, credit=4, timeout_s=20, **kw) as s:
            for x in s:
                got.append(x.key)
                if len(got) == take:
                    break
        time.sleep(0.3)
    finally:
        sc.stop()
    return sc, got


def test_breaking_out_leaves_the_last_yielded_sample_unacked(tmp_path):
    sc, got = _run(tmp_path, 6, 3)
    assert len(got) == 3
    assert sc.keys(P.Ack) == got[:2]  # asked past the first two only


def test_breaking_out_after_the_first_sample_acks_nothing(tmp_path):
    sc, got = _run(tmp_path, 4, 1)
    assert len(got) == 1 and sc.keys(P.Ack) == []


def test_manual_acks_are_the_loops_to_give(tmp_path):
    sc, got = _run(tmp_path, 4, 2, ack="manual")
    assert len(got) == 2 and sc.keys(P.Ack) == []
