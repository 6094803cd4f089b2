"""The soak's result handling (``make soak`` runs outside ``make test``; this keeps its verdict in CI).

The committed run's checks are re-derived from its own series and events, and each check is seen
failing on a record that breaks it (an ACK twice, one missing, a process that grew, a file left).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.long_checks.soak import verdict

RESULT = Path(__file__).resolve().parents[3] / "bench" / "results" / "soak_cpu.json"


def _series(n: int = 20, rss_end: float = 1.0) -> list[dict]:
    """A trainer's and a sidecar's measurements over ``n`` points; the trainer's RSS ends at
    ``rss_end`` times its start (flat in the 20-30 % window)."""
    pts = []
    for i in range(n):
        grow = rss_end if i >= int(0.9 * n) else 1.0
        pts.append({"t": float(i), "sidecar_pid": 1, "sidecar_rss": 100, "sidecar_fds": 10,
                    "trainer_pid": 2, "trainer_rss": int(1000 * grow), "trainer_fds": 5})  # fmt: skip
    return pts


EVENTS = [{"t": 1.0, "event": "trainer killed (SIGKILL) at 3 consumed; starting another"},
          {"t": 2.0, "event": "sidecar back"}]  # fmt: skip


def _run(**kw) -> dict:
    args = {"expected": {"a", "b", "c"}, "acked": ["a", "b", "c"], "series": _series(), "events": EVENTS,
            "consumed": 3, "failed": 0, "left": [], "ok": True}  # fmt: skip
    args.update(kw)
    expected = args.pop("expected")
    acked = args.pop("acked")
    series = args.pop("series")
    events = args.pop("events")
    return verdict(expected, acked, series, events, **args)


def test_a_clean_run_passes_every_check():
    v = _run()
    assert all(v["checks"].values()), v["checks"]
    assert v["acked_twice"] == 0 and v["never_acked"] == 0
    assert set(v["processes"]) == {"sidecar[1]", "trainer[2]"}


def test_each_check_fails_on_the_record_that_breaks_it():
    assert not _run(acked=["a", "b", "c", "b"])["checks"]["all_acked_exactly_once"]
    assert _run(acked=["a", "b", "c", "b"])["acked_twice"] == 1
    assert not _run(acked=["a", "b"])["checks"]["all_acked_exactly_once"]
    assert not _run(failed=1)["checks"]["all_acked_exactly_once"]
    assert not _run(ok=False)["checks"]["all_acked_exactly_once"]
    assert not _run(series=_series(rss_end=1.2))["checks"]["no_process_grew_10pct"]
    assert _run(series=_series(rss_end=1.05))["checks"]["no_process_grew_10pct"]
    assert not _run(series=_series(n=5))["checks"]["no_process_grew_10pct"]  # too few points judge nothing
    assert not _run(left=["job-0001.safetensors"])["checks"]["spool_empty_at_end"]
    assert not _run(events=EVENTS[1:])["checks"]["trainer_restarted"]
    assert not _run(events=EVENTS[:1])["checks"]["sidecar_restarted"]


def test_a_restarted_process_is_judged_on_its_own_run():
    """A new pid after a restart starts its own series: the old one's size is not its baseline."""
    old = [{"t": float(i), "trainer_pid": 2, "trainer_rss": 1000, "trainer_fds": 5} for i in range(12)]
    new = [{"t": 12.0 + i, "trainer_pid": 3, "trainer_rss": 3000, "trainer_fds": 5} for i in range(12)]
    v = _run(series=old + new)
    assert set(v["processes"]) == {"trainer[2]", "trainer[3]"}
    assert v["checks"]["no_process_grew_10pct"], v["processes"]


def test_the_committed_run_s_checks_follow_from_its_own_record():
    doc = json.loads(RESULT.read_text())
    v = verdict({str(i) for i in range(doc["samples"])}, [str(i) for i in range(doc["acked"])], doc["series"],
                doc["events"], consumed=doc["consumed"], failed=doc["failed"], left=[] if doc["spool_files_left"] == 0
                else ["?"] * (doc["spool_files_left"] or 1), ok=doc["spool_files_left"] is not None)  # fmt: skip
    assert v["checks"] == doc["checks"]
    assert {k: p["rss"]["growth"] for k, p in v["processes"].items()} == {
        k: p["rss"]["growth"] for k, p in doc["processes"].items()}
