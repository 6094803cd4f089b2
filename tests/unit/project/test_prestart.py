"""The engines started one module ahead (tests/support/prestart.py), with start/stop functions that
only record what happened: the order, the bound of one engine waiting, errors, and nothing left running."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.prestart import Entry, Prestarts


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.live: set[str] = set()
        self.most_waiting = 0
        self.lock = threading.Lock()

    def entry(self, name: str, module: int, fail: bool = False) -> Entry:
        def start() -> str:
            time.sleep(0.05)
            if fail:
                raise RuntimeError(f"{name} did not start")
            with self.lock:
                self.events.append(f"start {name}")
                self.live.add(name)
            return name

        def stop(value: str) -> None:
            with self.lock:
                self.events.append(f"stop {value}")
                self.live.discard(value)

        return Entry(name, module, start, stop)


def wait_for(cond, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def test_each_engine_is_started_once_in_run_order_and_only_one_waits_untaken():
    log = Log()
    p = Prestarts([log.entry("a", 0), log.entry("b1", 1), log.entry("b2", 1), log.entry("c", 2)])
    time.sleep(0.2)
    assert log.events == []  # nothing before the first test runs (its fixtures build what starts need)
    p.reached(0)
    wait_for(lambda: "start a" in log.events)
    time.sleep(0.3)
    assert log.events == ["start a"]  # "a" waits untaken: nothing more is started
    assert p.take("a", lambda: "own a") == "a"
    wait_for(lambda: "start b1" in log.events)
    time.sleep(0.2)
    assert log.events == ["start a", "start b1"]
    p.reached(1)
    assert p.take("b1", lambda: "own b1") == "b1"
    wait_for(lambda: p.entries["b2"].state != "pending")
    assert p.take("b2", lambda: "own b2") == "b2"  # under way or done: waited for, not started twice
    wait_for(lambda: "start c" in log.events)
    assert p.take("c", lambda: "own c") == "c"
    p.close()
    assert log.events == ["start a", "start b1", "start b2", "start c"]


def test_a_module_passed_without_taking_its_engine_has_it_stopped():
    log = Log()
    p = Prestarts([log.entry("a", 0), log.entry("b", 1), log.entry("c", 2)])
    p.reached(0)
    wait_for(lambda: "start a" in log.events)
    p.reached(1)  # module 0's tests did not take "a" (deselected or skipped)
    assert "stop a" in log.events and "a" not in log.live
    wait_for(lambda: "start b" in log.events)
    p.close()  # "b" started, never taken: stopped at the end
    assert log.live == set() and "start c" not in log.events


def test_a_failed_start_raises_in_the_fixture_that_takes_it():
    log = Log()
    p = Prestarts([log.entry("a", 0, fail=True), log.entry("b", 1)])
    p.reached(0)
    wait_for(lambda: p.entries["a"].state == "ready")
    with pytest.raises(RuntimeError, match="a did not start"):
        p.take("a", lambda: "own a")
    wait_for(lambda: "start b" in log.events)
    assert p.take("b", lambda: "own b") == "b"
    p.close()
    assert log.live == {"b"}  # taken: its fixture stops it, not the prestarts


def test_an_engine_not_yet_reached_is_started_by_the_fixture_itself_and_never_twice():
    log = Log()
    p = Prestarts([log.entry("a", 0), log.entry("b", 1)])
    # the thread has not run (no test reached): the fixture starts "a" itself, the thread skips it
    assert p.take("a", lambda: "own a") == "own a"
    p.reached(0)
    wait_for(lambda: "start b" in log.events)
    assert p.take("unknown", lambda: "own x") == "own x"
    p.close()
    assert log.events == ["start b", "stop b"]


def test_the_thread_outlives_its_last_start_until_closed():
    """Children started with PR_SET_PDEATHSIG (`hsstream up`'s) get SIGTERM when the thread that
    started them ends: the thread that started the last engine must live until the run closes it."""
    log = Log()
    p = Prestarts([log.entry("a", 0)])
    p.reached(0)
    wait_for(lambda: "start a" in log.events)
    assert p.take("a", lambda: "own a") == "a"
    time.sleep(0.2)
    assert p._thread.is_alive()
    p.close()
    assert not p._thread.is_alive()
