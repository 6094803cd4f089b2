"""The ledger's state machine and its recovery after a crash (real SQLite files)."""

from __future__ import annotations

import time

from connector import protocol as P
from server.ledger import Ledger, NewSample, NoticeOutcome, State


def new(n=4, tokens=10, nbytes=100):
    return [NewSample(list(range(i, i + tokens)), None, f"s{i}", nbytes) for i in range(n)]


def ok_notice(s, file):
    return P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt, file=file,
                    num_tokens=len(s.token_ids), nbytes=100)  # fmt: skip


def test_budget_admission_counts_expected_then_real_bytes():
    led = Ledger()
    led.add_job(new(4, nbytes=100))
    a = led.next_to_submit(budget=250)
    b = led.next_to_submit(budget=250)
    assert a and b and led.next_to_submit(budget=250) is None  # third would exceed 250
    assert led.reserved_bytes == 200
    assert led.on_notice(ok_notice(a, "a.safetensors"), 120) is NoticeOutcome.ready
    assert led.reserved_bytes == 220  # a's real file bytes replace its estimate
    a = led.lease_next(b"t", None)
    assert led.received(b"t", a.key, a.lease_token) == 120 and led.reserved_bytes == 100
    assert led.next_to_submit(budget=250) is not None


def test_ready_limit_pauses_submission():
    led = Ledger()
    led.add_job(new(3))
    a = led.next_to_submit(10**9, max_ready=1)
    led.on_notice(ok_notice(a, "a.safetensors"), 100)
    assert led.next_to_submit(10**9, max_ready=1) is None
    led.lease_next(b"t", None)
    assert led.next_to_submit(10**9, max_ready=1) is not None


def test_epochs_get_their_own_keys_in_a_seeded_shuffle():
    led = Ledger()
    j = led.add_job(new(5), epochs=3, seed=7)
    keys = [(s.key.epoch, s.key.index) for s in led.job_samples(j.job_id)]
    assert sorted(keys) == [(e, i) for e in range(3) for i in range(5)]
    orders = [[i for e, i in keys if e == ep] for ep in range(3)]
    assert len({tuple(o) for o in orders}) > 1  # reshuffled per epoch
    led2 = Ledger()
    j2 = led2.add_job(new(5), epochs=3, seed=7)
    assert [(s.key.epoch, s.key.index) for s in led2.job_samples(j2.job_id)] == keys  # deterministic


def test_recovery_after_crash(tmp_path):
    db = tmp_path / "ledger.sqlite"
    led = Ledger(db)
    j = led.add_job(new(5))
    s = [led.next_to_submit(10**9) for _ in range(5)]
    led.on_notice(ok_notice(s[1], "one.safetensors"), 100)  # READY, file present
    led.on_notice(ok_notice(s[2], "two.safetensors"), 100)
    led.on_notice(ok_notice(s[3], "three.safetensors"), 100)
    led.on_notice(ok_notice(s[4], "four.safetensors"), 100)
    led.lease_next(b"t", None)  # s1 leased, file still there
    led.lease_next(b"t", None)  # s2 leased, the trainer deleted the file
    s3 = led.lease_next(b"t", None)  # s3 leased and acked
    assert led.ack(b"t", s[3].key, s3.lease_token)
    jid = j.job_id
    # crash: no close; a new process opens the same file
    led2 = Ledger(db)
    present = {"one.safetensors", "four.safetensors"}
    stats = led2.recover(lambda f: f in present)
    j2 = led2.jobs[jid]
    st = {x.key.index: x for x in led2.job_samples(jid)}
    assert st[0].state == State.queued and st[0].attempt == 1  # was SUBMITTED
    assert st[1].state == State.ready  # leased, file there
    assert st[2].state == State.queued and st[2].attempt == 1  # leased, file gone: produce again
    assert st[3].state == State.consumed  # acked before the crash stays acked
    assert st[4].state == State.ready
    assert stats == {"resubmitted": 1, "ready": 2, "regenerate": 1}
    assert led2.live_files() == present
    # a late notice for the pre-crash attempt of sample 0 is discarded
    assert led2.on_notice(ok_notice(s[0], "late.safetensors"), 100) is NoticeOutcome.refused
    # the consumed sample's ack is not counted again
    assert not led2.ack(b"other", st[3].key, s3.lease_token)
    assert j2.tokens_consumed == 10


def test_ack_after_restart_from_a_trainer_that_used_it_counts_once(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    j = led.add_job(new(1))
    s = led.next_to_submit(10**9)
    led.on_notice(ok_notice(s, "f.safetensors"), 100)
    token = led.lease_next(b"old-identity", None).lease_token
    led2 = Ledger(tmp_path / "l.sqlite")
    led2.recover(lambda f: True)
    key = led2.job_samples(j.job_id)[0].key
    assert not led2.ack(b"new-identity", key, "0" * 32)  # the lease's token, kept on disk, is the proof
    assert led2.ack(b"new-identity", key, token)  # nobody holds it: the trainer did use it
    assert not led2.ack(b"new-identity", key, token)
    assert led2.jobs[j.job_id].counts()["consumed"] == 1


def test_cancel_returns_files_and_discards_late_notices():
    led = Ledger()
    j = led.add_job(new(3))
    a, b = led.next_to_submit(10**9), led.next_to_submit(10**9)
    led.on_notice(ok_notice(a, "a.safetensors"), 100)
    assert led.cancel_job(j.job_id) == ["a.safetensors"]
    assert j.counts()["cancelled"] == 3 and j.done and led.reserved_bytes == 0
    assert led.on_notice(ok_notice(b, "b.safetensors"), 100) is NoticeOutcome.refused


def test_trainer_gone_returns_leases():
    led = Ledger()
    j = led.add_job(new(2))
    a, b = led.next_to_submit(10**9), led.next_to_submit(10**9)
    led.on_notice(ok_notice(a, "a.safetensors"), 100)
    led.on_notice(ok_notice(b, "b.safetensors"), 100)
    led.lease_next(b"t", None)
    led.lease_next(b"t", None)
    assert led.release_owner(b"t", lambda f: f == "a.safetensors") == 2
    c = j.counts()
    assert c["ready"] == 1 and c["queued"] == 1


def test_vllm_down_does_not_spend_attempts():
    led = Ledger(max_attempts=2)
    j = led.add_job(new(1))
    for _ in range(5):
        s = led.next_to_submit(10**9)
        led.requeue(s.key, s.attempt, "connection refused", count_attempt=False)
    assert led.job_samples(j.job_id)[0].state == State.queued and not led.job_samples(j.job_id)[0].errors
    s = led.next_to_submit(10**9)
    led.requeue(s.key, s.attempt, "500")
    s = led.next_to_submit(10**9)
    led.requeue(s.key, s.attempt, "500")
    assert led.job_samples(j.job_id)[0].state == State.failed and len(led.job_samples(j.job_id)[0].errors) == 2


def test_watermarks_resume_only_after_draining_to_low():
    led = Ledger()
    led.add_job(new(10, nbytes=100))
    subs = [led.next_to_submit(budget=400, low_water=0.5) for _ in range(4)]
    assert all(subs) and led.next_to_submit(budget=400, low_water=0.5) is None  # high watermark hit
    led.requeue(subs[0].key, subs[0].attempt, "x", count_attempt=False)  # 300 reserved: room for one...
    assert led.next_to_submit(budget=400, low_water=0.5) is None  # ...but not yet down to 200
    led.requeue(subs[1].key, subs[1].attempt, "x", count_attempt=False)  # 200: resume
    assert led.next_to_submit(budget=400, low_water=0.5) is not None
    assert led.next_to_submit(budget=400, low_water=0.5) is not None  # a batch, not a trickle


def test_ipc_directory_must_be_private(tmp_path):
    import pytest

    from server.notices import prepare_ipc

    d = tmp_path / "run"
    prepare_ipc(f"ipc://{d}/n.sock")
    assert (d.stat().st_mode & 0o777) == 0o700
    d.chmod(0o777)
    with pytest.raises(PermissionError, match="not be writable by others"):
        prepare_ipc(f"ipc://{d}/n.sock")


def test_regenerate_retry_starts_again_from_the_prompt(tmp_path):
    """A regenerate-mode sample that goes back to QUEUED after its reply was known must be
    resubmitted with the prompt alone (the old reply must not become part of the prompt),
    also across a restart."""
    led = Ledger(tmp_path / "l.sqlite")
    j = led.add_job([NewSample([1, 2, 3], [0, 0, 0], None, 1000)], sampling={"max_tokens": 4})
    s = led.next_to_submit(10**9)
    led.set_generated(s.key, s.attempt, [7, 8, 9])
    assert s.token_ids == [1, 2, 3, 7, 8] and s.loss_mask == [0, 0, 0, 1, 1]
    err = P.Notice(status=P.NoticeStatus.error, reason="write failed", request_id="r", key=s.key, attempt=s.attempt)
    led.on_notice(err, 0)
    assert s.state == State.queued and s.token_ids == [1, 2, 3] and s.loss_mask == [0, 0, 0] and not s.generated
    # after a restart with an early file of an in-flight attempt: back to the prompt, no stale notice
    s = led.next_to_submit(10**9)
    led.on_notice(ok_notice(s, "early.safetensors"), 900)  # file first, reply not yet known
    led.set_generated(s.key, s.attempt, [5, 6])  # reply known: READY
    assert s.state == State.ready
    led2 = Ledger(tmp_path / "l.sqlite")
    led2.recover(lambda f: False)  # its file is gone
    s2 = led2.job_samples(j.job_id)[0]
    assert s2.state == State.queued and s2.token_ids == [1, 2, 3] and s2.notice is None and led2.reserved_bytes == 0


def test_received_from_a_trainer_without_the_lease_regenerates():
    led = Ledger()
    led.add_job(new(1))
    s = led.next_to_submit(10**9)
    led.on_notice(ok_notice(s, "f.safetensors"), 100)
    token = led.lease_next(b"a", None).lease_token
    led.release_owner(b"a", lambda f: True)  # a's lease lapsed: READY again
    assert led.received(b"a", s.key, "f" * 32) == 0 and s.state == State.ready  # not its lease: nothing
    assert led.received(b"a", s.key, token) == 0  # a's late RECEIVED: a took the file with it
    assert s.state == State.queued and led.reserved_bytes == 0  # produced again, never offered fileless


def test_sample_payloads_live_in_sqlite_not_in_ram(tmp_path):
    """Queued and finished samples are rows, not objects: RAM is O(in flight). 20,000 queued
    samples of 256 tokens held as Python lists would take ~200 MB."""
    import gc
    import tracemalloc

    led = Ledger(tmp_path / "l.sqlite")
    gc.collect()
    tracemalloc.start()  # before the rows exist: whatever keeps them alive is counted
    rows = [NewSample(list(range(i, i + 256)), [1] * 256, None, 100) for i in range(20_000)]
    j = led.add_job(rows)
    del rows
    gc.collect()
    kept, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert kept < 4 * 2**20, f"{kept / 2**20:.1f} MiB kept in RAM for 20,000 queued samples"
    subs = [led.next_to_submit(10**12) for _ in range(10)]
    assert led.in_flight() == 10 and len(led.stale_submissions(-1)) == 10
    for s in subs:
        led.on_notice(ok_notice(s, f"{s.key.index}.safetensors"), 100)
        x = led.lease_next(b"t", None)
        assert led.ack(b"t", s.key, x.lease_token)
    assert led.in_flight() == 0  # consumed samples leave RAM
    assert j.counts()["consumed"] == 10 and j.counts()["queued"] == 19_990
    assert led.job_samples(j.job_id)[0].token_ids == list(range(256))  # still in SQLite


def test_errors_are_paged_from_sqlite_and_counted_per_job():
    led = Ledger(max_attempts=5)
    j = led.add_job(new(6))
    for _ in range(6):
        s = led.next_to_submit(10**9)
        if s.key.index % 2:
            led.requeue(s.key, s.attempt, f"boom {s.key.index}")
    assert j.n_errors == 3
    page = led.errors_page(j.job_id, 1, 10)
    assert [x.key.index for x in page] == [3, 5] and page[0].errors == ["attempt 0: boom 3"]


def test_finished_jobs_are_compacted_after_the_retention(tmp_path):
    db = tmp_path / "l.sqlite"
    led = Ledger(db)
    done, live = led.add_job(new(2)), led.add_job(new(1))
    for _ in range(2):
        s = led.next_to_submit(10**9)
        led.on_notice(ok_notice(s, f"{s.key.index}.safetensors"), 100)
        x = led.lease_next(b"t", None)
        led.ack(b"t", s.key, x.lease_token)
    assert done.done and not live.done
    assert led.compact(3600) == []  # within the retention: kept
    assert led.compact(3600, now=time.time() + 7200) == [done.job_id]
    assert led.job_samples(done.job_id) == [] and done.job_id not in led.jobs
    v = led.job_view(done.job_id)
    assert v.compacted and v.done and v.counts()["consumed"] == 2 and v.tokens_consumed == 20
    assert not led.ack(b"t", P.SampleKey(job=done.job_id, index=0), x.lease_token)  # a late ack changes nothing
    assert led.jobs_done([done.job_id]) and not led.jobs_done([live.job_id])
    assert led.job_view(live.job_id) is live  # unfinished jobs are never compacted
    led2 = Ledger(db)  # after a restart the summary is what remains
    led2.recover(lambda f: False)
    assert done.job_id not in led2.jobs and led2.job_view(done.job_id).counts()["consumed"] == 2
    assert led2.jobs[live.job_id].counts()["queued"] == 1


def test_busy_notice_resubmits_without_spending_an_attempt():
    """The connector had no room to write (HSSTREAM_MAX_PENDING_WRITE_BYTES): not the sample's
    fault, so it is queued again with a new attempt number and no error counted."""
    led = Ledger(max_attempts=1)
    j = led.add_job(new(1, nbytes=100))
    s = led.next_to_submit(10**9)
    busy = P.Notice(status=P.NoticeStatus.busy, reason="connector busy", request_id="r", key=s.key, attempt=s.attempt)
    assert led.on_notice(busy, 0) is NoticeOutcome.refused
    again = led.next_to_submit(10**9)
    assert again.key == s.key and again.attempt == 1 and not again.errors and led.reserved_bytes == 100
    assert j.counts()["failed"] == 0 and j.n_errors == 0


class _CountingDb:
    """A sqlite connection that counts COMMITs and can fail the n-th one (disk full at commit,
    where a WAL write really fails)."""

    def __init__(self, db, fail_commit_at: int | None = None) -> None:  # noqa: ANN001
        self.db, self.commits, self.fail_commit_at = db, 0, fail_commit_at

    def execute(self, sql: str, *a):  # noqa: ANN002, ANN201
        if sql == "COMMIT":
            self.commits += 1
            if self.commits == self.fail_commit_at:
                import sqlite3

                self.db.execute("ROLLBACK")  # what SQLite does itself on SQLITE_FULL
                raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *a)


def _ready(led, n, tmp_files=True):  # noqa: ANN001, ANN202
    led.add_job(new(n))
    out = []
    for i in range(n):
        s = led.next_to_submit(10**9)
        led.on_notice(ok_notice(s, f"f{i}.safetensors"), 100)
        out.append(s)
    return out


def test_a_group_is_one_commit_seen_by_no_one_before_it_and_keeps_what_was_applied_on_error(tmp_path):
    import sqlite3
    import threading

    path = tmp_path / "l.sqlite"
    led = Ledger(path)
    s = _ready(led, 3)
    other = sqlite3.connect(path)  # another reader of the file (a restarted sidecar would read this)
    led._db = counting = _CountingDb(led._db)
    seen = []
    with led.group():
        for x in s:
            y = led.lease_next(b"t", None)
            led.ack(b"t", x.key, y.lease_token)
        assert {r[0] for r in other.execute("SELECT state FROM samples")} == {"ready"}  # nothing on disk yet
        t = threading.Thread(target=lambda: seen.append(led.job_view(s[0].key.job).counts()["consumed"]))
        t.start()
        t.join(0.2)
        assert t.is_alive() and not seen  # a REST read waits for the commit
    t.join(5)
    assert seen == [3] and counting.commits == 1
    assert {r[0] for r in other.execute("SELECT state FROM samples")} == {"consumed"}
    # an error part-way: what was applied before it is committed, as one commit per transition would have
    led2 = Ledger(tmp_path / "l2.sqlite")
    s2 = _ready(led2, 2)
    try:
        with led2.group():
            led2.lease_next(b"t", None)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    states = dict(sqlite3.connect(tmp_path / "l2.sqlite").execute("SELECT idx, state FROM samples").fetchall())
    assert states == {s2[0].key.index: "leased", s2[1].key.index: "ready"}


def test_lease_many_is_one_commit_and_leases_none_if_it_fails(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    s = _ready(led, 5)
    job = led.jobs[s[0].key.job]
    led._db = counting = _CountingDb(led._db, fail_commit_at=1)
    try:
        led.lease_many(b"t", None, 3)
        raise AssertionError("the failed commit must propagate")
    except Exception as e:  # noqa: BLE001
        assert "disk is full" in str(e)
    # none leased, in memory or on disk; the counts as before
    assert [led.get(x.key).state for x in s] == [State.ready] * 5
    assert all(led.get(x.key).lease_owner is None for x in s)
    assert led.ready_count() == 5 and job.counts()["ready"] == 5 and job.counts()["leased"] == 0
    got = led.lease_many(b"t", None, 3)
    assert [x.key for x in got] == [x.key for x in s[:3]]  # the same ones, in the same order
    assert counting.commits == 2 and led.ready_count() == 2 and job.counts()["leased"] == 3
    assert [x.key for x in led.lease_many(b"t", None, 10)] == [x.key for x in s[3:]]
    assert led.lease_many(b"t", None, 10) == []
    on_disk = {r[0] for r in led._db.db.execute("SELECT state FROM samples")}
    assert on_disk == {"leased"}


def test_a_move_the_transition_table_does_not_name_is_refused_before_anything_is_written():
    import pytest

    from server.ledger import IllegalTransition

    led = Ledger()
    led.add_job(new(1))
    s = led.next_to_submit(10**9)
    led.fail(s.key, "refused")
    done = led.get(s.key)
    assert done.state == State.failed
    done.state = State.ready  # a finished sample never comes back
    with pytest.raises(IllegalTransition, match="from failed to ready"):
        led._save(done)
    assert led.get(s.key).state == State.failed and led.jobs[s.key.job].counts()["failed"] == 1


def test_the_transition_table_names_every_state_and_ends_in_the_terminal_ones():
    from server.ledger import TERMINAL, TRANSITIONS

    assert set(TRANSITIONS) == set(State)
    for st, nxt in TRANSITIONS.items():
        assert (not nxt) if st in TERMINAL else TERMINAL <= nxt, st


def test_a_cancelled_job_is_purged_at_once_and_an_unfinished_one_never(tmp_path):
    """``DELETE /v1/jobs/{id}?purge=true`` (``hsstream proxy forget``): the rows of a cancelled
    job go now, not after the retention; its counts stay; a job still running is not touched."""
    db = tmp_path / "l.sqlite"
    led = Ledger(db)
    gone, live = led.add_job(new(3)), led.add_job(new(2))
    a = led.next_to_submit(10**9)
    led.on_notice(ok_notice(a, "a.safetensors"), 100)
    assert not led.purge(gone.job_id)  # not finished: refused, nothing deleted
    assert len(led.job_samples(gone.job_id)) == 3
    led.cancel_job(gone.job_id)
    assert led.purge(gone.job_id)
    assert led.job_samples(gone.job_id) == [] and gone.job_id not in led.jobs
    assert led.job_view(gone.job_id).compacted and led.job_view(gone.job_id).counts()["cancelled"] == 3
    assert led._db.execute("SELECT count(*) FROM samples WHERE job_id=?", (gone.job_id,)).fetchone()[0] == 0  # noqa: SLF001
    assert not led.purge(live.job_id) and len(led.job_samples(live.job_id)) == 2
    assert not led.purge("no-such-job")
