"""A big job goes into the ledger a batch at a time: the lock is free between batches, so the
notice and delivery threads and status reads never wait for the whole job, and a job whose rows
were not all written (the sidecar died meanwhile) is dropped on restart."""

from __future__ import annotations

import threading
import time

import pytest

from server.ledger import Ledger, NewSample, State


def test_other_threads_get_the_lock_while_a_big_job_is_written():
    led = Ledger()
    rows = [NewSample([1, 2, 3, 4], None, None, 100) for _ in range(20_000)]
    done = threading.Event()
    t = threading.Thread(target=lambda: (led.add_job(rows, epochs=10), done.set()))
    waits = []
    start = time.monotonic()
    t.start()
    while not done.is_set():
        t0 = time.monotonic()
        led.job_view("unknown")  # a status read: takes the ledger's lock
        waits.append(time.monotonic() - t0)
        time.sleep(0.005)
    t.join()
    total = time.monotonic() - start
    # Relative to the whole write, so a loaded machine does not fail it: one transaction for the
    # whole job makes the first read wait for all of it.
    assert len(waits) > 3 and max(waits) < total / 4, (
        f"waited {max(waits):.2f} s for the lock while the job took {total:.2f} s ({len(waits)} reads)")
    job = next(iter(led.jobs.values()))
    assert job.num_samples == 200_000 and job.counts()["queued"] == 200_000 and not job.admitting


def test_a_job_being_written_is_not_done():
    led = Ledger()
    seen = []
    led.listeners.append(lambda new, old, n, _t: seen.append(next(iter(led.jobs.values())).done))
    led.add_job([NewSample([1], None, None, 1) for _ in range(5)], epochs=3, batch=2)
    assert seen and not any(seen)


def test_a_job_half_written_when_the_sidecar_died_is_dropped_on_restart(tmp_path):
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    keep = led.add_job([NewSample([1], None, None, 1)])

    def die(new, old, n, _t):  # the first batch is on disk, the rest never comes
        if old is None and len(led.jobs) == 2:
            raise SystemExit("killed")

    led.listeners.append(die)
    with pytest.raises(SystemExit):
        led.add_job([NewSample([2], None, None, 1) for _ in range(10)], batch=4)
    led.close()
    led = Ledger(path)
    stats = led.recover(lambda _f: False)
    assert stats.get("half_admitted_jobs_dropped") == 1
    assert list(led.jobs) == [keep.job_id] and led.job_ids() == [keep.job_id]
    assert led.next_to_submit(10**9).key.job == keep.job_id and led.next_to_submit(10**9) is None
    assert led.jobs[keep.job_id].counts()[State.submitted.value] == 1


def test_admitting_a_job_from_a_stream_of_samples_holds_a_batch_in_memory_not_the_job(tmp_path):
    """Samples staged as they come (a generator here, as the upload route's): the peak while
    a job of 50,000 samples of 64 tokens is admitted is about one batch of them (2,000 samples,
    ~5 MiB as Python lists); the whole job as a list is ~120 MiB."""
    import tracemalloc

    led = Ledger(tmp_path / "l.sqlite")
    gen = (NewSample(list(range(i, i + 64)), None, None, 100) for i in range(50_000))
    tracemalloc.start()
    job = led.add_job(gen, epochs=2, seed=3)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 12 * 2**20, f"{peak / 2**20:.1f} MiB at the peak of admitting 50,000 samples"
    assert job.num_samples == 100_000 and job.counts()["queued"] == 100_000 and not job.admitting
    assert led._db.execute("SELECT count(*) FROM staged_samples").fetchone()[0] == 0  # moved, none left
    # the same seeded shuffles as ever: epoch e is a permutation of the samples, each once
    for ep in (0, 1):
        idx = [r[0] for r in led._db.execute("SELECT idx FROM samples WHERE job_id=? AND epoch=? ORDER BY ord",
                                             (job.job_id, ep))]  # fmt: skip
        assert sorted(idx) == list(range(50_000)) and idx != sorted(idx)
    s = led.next_to_submit(10**9)
    assert s.token_ids == list(range(s.key.index, s.key.index + 64)) and s.key.epoch == 0


def test_a_staged_job_is_seen_by_no_one_and_dropped_whole():
    led = Ledger()
    w = led.begin_job()
    w.stage([NewSample([1, 2], None, None, 10) for _ in range(5)])
    assert w.n == 5 and not led.jobs and led.job_ids() == [] and led.next_to_submit(10**9) is None
    w.drop()
    assert led._db.execute("SELECT count(*) FROM staged_samples").fetchone()[0] == 0 and led.job_ids() == []


def test_samples_staged_when_the_sidecar_died_are_dropped_on_restart(tmp_path):
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    keep = led.add_job([NewSample([1], None, None, 1)])
    led.begin_job().stage([NewSample([2], None, None, 1) for _ in range(7)])  # killed before its commit
    led.close()
    led = Ledger(path)
    assert led.recover(lambda _f: False) == {"staged_samples_dropped": 7}
    assert led._db.execute("SELECT count(*) FROM staged_samples").fetchone()[0] == 0
    assert led.job_ids() == [keep.job_id] and led.jobs[keep.job_id].num_samples == 1
