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
