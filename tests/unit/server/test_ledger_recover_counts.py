"""After a restart the ledger's counts start from what it recovered: READY samples count toward
``max_ready``, and the moves recovery makes (SUBMITTED → QUEUED) are not told to listeners that
never heard those samples go out (the submitter's in-flight count would go below zero)."""

from __future__ import annotations

from connector import protocol as P
from server.ledger import Ledger, NewSample, State


def _notice(s, file):  # noqa: ANN001, ANN202
    return P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt, file=file,
                    num_tokens=len(s.token_ids), nbytes=100)  # fmt: skip


def test_ready_samples_count_after_a_restart_and_recovery_moves_are_not_told(tmp_path):
    db = tmp_path / "ledger.sqlite"
    led = Ledger(db)
    led.add_job([NewSample(list(range(i, i + 8)), None, f"s{i}", 100) for i in range(5)])
    sent = [led.next_to_submit(10**9) for _ in range(5)]
    for s in sent[:3]:
        led.on_notice(_notice(s, f"{s.key}.safetensors"), 100)
    assert led.ready_count() == 3
    del led

    led = Ledger(db)
    heard = []
    led.listeners.append(lambda new, old, n, tokens: heard.append((new, old, n)))
    stats = led.recover(lambda f: True)
    assert stats["ready"] == 3 and stats["resubmitted"] == 2, stats
    assert led.ready_count() == 3  # the max_ready throttle sees them
    assert heard == []  # nobody heard a SUBMITTED → QUEUED they never saw start
    assert led.next_to_submit(10**9, max_ready=3) is None  # 3 waiting for a trainer: throttled
    a = led.lease_next(b"t", None)
    assert a is not None and led.ready_count() == 2
    assert led.next_to_submit(10**9, max_ready=3) is not None
    assert heard and all(old is not None for _new, old, _n in heard)
    assert {new for new, _old, _n in heard} <= {State.leased, State.submitted}
