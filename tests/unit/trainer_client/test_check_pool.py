"""The stream's check pool: results in submission order, bounded, nothing left running after close."""

from __future__ import annotations

import os
import select
import threading
import time

import pytest

from trainer_client.check_pool import THREAD_PREFIX, CheckPool, PoolFull


def _workers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def test_results_come_back_in_submission_order_although_they_finish_out_of_order():
    pool = CheckPool(workers=4, limit=8)
    finished: list[int] = []

    def job(i: int, sleep_s: float) -> int:
        time.sleep(sleep_s)
        finished.append(i)
        return i * 10

    for i, s in enumerate([0.3, 0.0, 0.1, 0.0, 0.2]):
        pool.submit(i, job, i, s)
    got = []
    while len(pool):
        if not pool.has_result():
            select.select([pool.fileno()], [], [], 1.0)  # the owner's wake-up: a job finished
            pool.clear_wakeups()
            continue
        tag, fut = pool.pop()
        got.append((tag, fut.result()))
    assert finished != sorted(finished)  # the workers did finish out of order ...
    assert got == [(i, i * 10) for i in range(5)]  # ... and the owner sees submission order
    pool.close()


def test_unordered_results_come_back_as_they_finish_and_a_slow_job_holds_none_back():
    pool = CheckPool(workers=4, limit=8, ordered=False)
    gate = threading.Event()
    pool.submit("slow", gate.wait, 5)  # the oldest job, still running
    for i in range(3):
        pool.submit(i, lambda i=i: i * 10)
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        if not pool.has_result():
            select.select([pool.fileno()], [], [], 1.0)
            pool.clear_wakeups()
            continue
        tag, fut = pool.pop()
        got.append((tag, fut.result()))
    assert sorted(got) == [(i, i * 10) for i in range(3)]  # none waited for "slow"
    assert not pool.has_result() and pool.tags() == ["slow"]
    with pytest.raises(RuntimeError, match="no job has finished"):
        pool.pop()
    gate.set()
    left = pool.close()
    assert [t for t, _ in left] == ["slow"]


def test_held_jobs_and_running_workers_are_bounded():
    pool = CheckPool(workers=3, limit=5)
    gate = threading.Event()
    for i in range(5):
        pool.submit(i, gate.wait, 5)
    with pytest.raises(PoolFull):
        pool.submit(5, gate.wait, 5)
    t0 = time.monotonic()
    while pool.running < 3 and time.monotonic() - t0 < 5:  # the workers pick their jobs up
        time.sleep(0.01)
    time.sleep(0.05)  # and no fourth one starts
    assert pool.running == 3  # two wait in the queue
    gate.set()
    pool.close()
    assert pool.max_running == 3 and pool.max_held == 5


def test_inline_pool_runs_each_job_in_submit_and_keeps_its_exception():
    pool = CheckPool(workers=0, limit=2)
    pool.submit("a", lambda: threading.current_thread().name)
    pool.submit("b", lambda: 1 / 0)
    assert pool.fileno() == -1 and not _workers_alive()
    tag, fut = pool.pop()
    assert (tag, fut.result()) == ("a", threading.current_thread().name)
    tag, fut = pool.pop()
    assert tag == "b" and isinstance(fut.exception(), ZeroDivisionError)


def test_close_finishes_held_jobs_returns_them_in_order_and_stops_every_worker():
    pool = CheckPool(workers=2, limit=6)
    done: list[int] = []

    def job(i: int) -> int:
        time.sleep(0.05)
        done.append(i)
        return i

    for i in range(6):
        pool.submit(i, job, i)
    assert _workers_alive()
    rfd = pool.fileno()
    left = pool.close()
    assert [t for t, _ in left] == list(range(6)) and [f.result() for _, f in left] == list(range(6))
    assert sorted(done) == list(range(6))
    assert not _workers_alive() and pool.fileno() == -1
    with pytest.raises(OSError):
        os.fstat(rfd)  # the wake-up pipe is closed too


def test_pop_refuses_an_unfinished_job():
    pool = CheckPool(workers=1, limit=1)
    gate = threading.Event()
    pool.submit(0, gate.wait, 5)
    with pytest.raises(RuntimeError, match="not finished"):
        pool.pop()
    gate.set()
    pool.close()
