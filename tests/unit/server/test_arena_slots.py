"""The arena layout on the sidecar's side: the slot allocator's policy, the ledger's slot table
(assigned at submission, given back when the bytes are free or into quarantine when a writer or
reader may still touch them, rebuilt after a restart) and the schema step that adds it."""

from __future__ import annotations

import random
import sqlite3

import pytest

from connector import protocol as P
from connector.contract import arena as A
from server.arena import SlotAllocator, open_arena
from server.ledger import SCHEMA_VERSION, Ledger, NewSample, State

ARENA_ID = "ab" * 16
MB = 1 << 20


def _alloc(size: int = 64 * A.PAGE, q: float = 0.0) -> SlotAllocator:
    return SlotAllocator(ARENA_ID, size, quarantine_s=q)


def test_first_fit_pages_and_merge_back_into_one_range():
    a = _alloc()
    s1, s2, s3 = a.alloc(1), a.alloc(A.PAGE + 1), a.alloc(3 * A.PAGE)
    assert (s1.offset, s1.length) == (A.PAGE, A.PAGE)  # the first page is the arena's header
    assert (s2.offset, s2.length) == (2 * A.PAGE, 2 * A.PAGE)
    assert s3.offset == 4 * A.PAGE and s3.generation > s2.generation > s1.generation
    a.free(s2)
    s4 = a.alloc(A.PAGE)  # first fit: the hole s2 left
    assert s4.offset == s2.offset
    for s in (s1, s3, s4):
        a.free(s)
    st = a.stats()
    assert st.slots == 0 and st.used_bytes == 0 and st.largest_free == st.free_bytes == 63 * A.PAGE


def test_random_alloc_free_never_overlaps_and_always_merges_back():
    rng = random.Random(7)
    a = _alloc(512 * A.PAGE)
    held: list[A.Slot] = []
    for _ in range(3000):
        if held and rng.random() < 0.5:
            a.free(held.pop(rng.randrange(len(held))))
        elif (s := a.alloc(rng.randint(1, 20 * A.PAGE))) is not None:
            assert all(s.end <= h.offset or h.end <= s.offset for h in held), "slots overlap"
            held.append(s)
    for s in held:
        a.free(s)
    assert a.stats().largest_free == 511 * A.PAGE  # everything merged: nothing leaked


def test_a_sample_larger_than_any_free_range_waits_and_one_larger_than_the_arena_never_fits():
    a = _alloc(8 * A.PAGE)
    s = a.alloc(4 * A.PAGE)
    assert a.alloc(4 * A.PAGE) is None and a.stats().refused == 1
    assert a.fits_ever(7 * A.PAGE) and not a.fits_ever(7 * A.PAGE + 1)
    a.free(s)
    assert a.alloc(7 * A.PAGE) is not None


def test_quarantine_holds_a_slot_back_until_its_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("server.arena.time.monotonic", lambda: now[0])
    a = _alloc(3 * A.PAGE, q=60.0)
    s = a.alloc(2 * A.PAGE)
    a.free(s, quarantine=True)
    assert a.alloc(A.PAGE) is None and a.stats().quarantined_bytes == 2 * A.PAGE
    now[0] += 61
    assert a.alloc(2 * A.PAGE) is not None


def test_double_free_and_foreign_slots_are_ignored_and_reserve_refuses_overlaps():
    a = _alloc()
    s = a.alloc(A.PAGE)
    a.free(s)
    a.free(s)
    a.free(A.Slot(arena="cd" * 16, offset=A.PAGE, length=A.PAGE, generation=1))
    assert a.stats().free_bytes == 63 * A.PAGE
    b = _alloc()
    assert b.reserve(A.Slot(arena=ARENA_ID, offset=2 * A.PAGE, length=2 * A.PAGE, generation=5))
    assert not b.reserve(A.Slot(arena=ARENA_ID, offset=3 * A.PAGE, length=A.PAGE, generation=6))  # overlaps
    assert not b.reserve(A.Slot(arena="cd" * 16, offset=8 * A.PAGE, length=A.PAGE, generation=6))
    assert b.alloc(A.PAGE).offset == A.PAGE and b.alloc(A.PAGE).offset == 4 * A.PAGE


# -- the ledger's slots ------------------------------------------------------------------------


def _ledger(path=None, size=64 * A.PAGE, q=0.0) -> tuple[Ledger, SlotAllocator]:
    led = Ledger(path)
    slots = SlotAllocator(ARENA_ID, size, quarantine_s=q)
    led.attach_slots(slots)
    return led, slots


def _ok(s, slot=None) -> P.Notice:
    return P.Notice(status=P.NoticeStatus.ok, request_id="r", key=s.key, attempt=s.attempt,
                    slot=s.slot if slot is None else slot, num_tokens=3, nbytes=30)  # fmt: skip


def test_a_slot_lives_from_submission_until_the_trainers_received():
    led, slots = _ledger()
    led.add_job([NewSample([1, 2, 3], None, None, 2 * A.PAGE)])
    s = led.next_to_submit(10**9)
    assert s.slot is not None and s.slot.length == 2 * A.PAGE and slots.stats().slots == 1
    assert led.on_notice(_ok(s), s.slot.length).name == "ready"
    leased = led.lease_next(b"t", None)
    assert led.ack(b"t", leased.key, "wrong") is False
    assert led.received(b"t", leased.key, leased.lease_token) == 2 * A.PAGE
    assert slots.stats().slots == 0 and slots.stats().quarantined_bytes == 0  # freed at once, no quarantine
    assert led.ack(b"t", leased.key, leased.lease_token)
    assert led._store.load(leased.key).slot is None


def test_a_notice_for_another_slot_is_refused_and_the_sample_keeps_its_own():
    led, slots = _ledger()
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE)])
    s = led.next_to_submit(10**9)
    other = s.slot.model_copy(update={"generation": s.slot.generation + 1})
    assert led.on_notice(_ok(s, other), A.PAGE).name == "refused"
    assert led.get(s.key).state == State.submitted and slots.stats().slots == 1
    assert led.on_notice(_ok(s), A.PAGE).name == "ready"


def test_an_abandoned_request_and_a_busy_notice_both_quarantine_their_slots(monkeypatch):
    led, slots = _ledger(size=16 * A.PAGE, q=60.0)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE), NewSample([4, 5, 6], None, None, A.PAGE)])
    a = led.next_to_submit(10**9)
    led.requeue(a.key, a.attempt, "timed out")  # its writer may still write into it
    assert slots.stats().quarantined_bytes == A.PAGE and led.get(a.key).slot is None
    b = led.next_to_submit(10**9)
    busy = P.Notice(status=P.NoticeStatus.busy, request_id="r", key=b.key, attempt=b.attempt, slot=b.slot)
    led.on_notice(busy, 0)  # a notice is no proof that no writer is left (it may be forged)
    st = slots.stats()
    assert st.slots == 0 and st.quarantined_bytes == 2 * A.PAGE


def test_a_lost_trainers_slot_samples_are_produced_again_not_handed_to_the_next_one():
    """A trainer gone (silent past its timeout, killed) had its slots' bytes in its hands, read
    without a checksum: what it did to them is unknown, so the next trainer gets the sample
    produced again, never that slot (issue 40: trainer A add_(1.0)'d its view and went quiet, B
    was yielded A's bytes). A file's sample still goes to the next trainer: every reader checks
    a file's checksum."""
    led, slots = _ledger(q=60.0)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE), NewSample([4, 5, 6], None, None, 0)])
    s, f = led.next_to_submit(10**9), led.next_to_submit(10**9)
    assert s.slot is not None and f.slot is None  # the second has no known size: a file
    led.on_notice(_ok(s), A.PAGE)
    led.on_notice(P.Notice(status=P.NoticeStatus.ok, request_id="r", key=f.key, attempt=f.attempt,
                           file="hs-f.safetensors", num_tokens=3, nbytes=30), 30)  # fmt: skip
    first, file_one = led.lease_next(b"t1", None), led.lease_next(b"t1", None)
    attempt, slot = first.attempt, first.notice.slot
    assert led.release_owner(b"t1", lambda name: True) == 2  # gone with both in its hands
    again = led.get(first.key)
    assert again.state == State.queued and again.attempt == attempt + 1 and again.slot is None
    assert not again.errors  # not the sample's fault: no attempt spent
    assert slots.stats().slots == 0 and slots.stats().quarantined_bytes == A.PAGE  # not reused at once
    assert led.get(file_one.key).state == State.ready  # a file: the next reader checks it
    nxt = led.lease_next(b"t2", None)
    assert nxt.key == file_one.key and led.lease_next(b"t2", None) is None  # the slot's is never handed on
    resub = led.next_to_submit(10**9)
    assert resub.key == first.key and resub.slot is not None and resub.slot.generation > slot.generation


def test_regenerate_jobs_unknown_sizes_and_samples_larger_than_the_arena_get_files():
    led, slots = _ledger(size=8 * A.PAGE)
    led.add_job([NewSample([1, 2, 3], None, None, 0), NewSample([1, 2, 3], None, None, 64 * A.PAGE)])
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE)], sampling={"temperature": 1.0})
    assert [led.next_to_submit(10**12).slot for _ in range(3)] == [None, None, None]
    assert slots.stats().slots == 0


def test_a_full_arena_throttles_submission_until_a_slot_is_freed():
    led, slots = _ledger(size=3 * A.PAGE)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE) for _ in range(3)])
    a, b = led.next_to_submit(10**9), led.next_to_submit(10**9)
    assert led.next_to_submit(10**9) is None  # both slots taken; the budget alone would admit it
    led.on_notice(_ok(a), A.PAGE)
    t = led.lease_next(b"t", None)
    led.received(b"t", t.key, t.lease_token)
    assert led.next_to_submit(10**9, low_water=1.0) is not None and b.slot is not None


def test_a_restart_rebuilds_the_slot_table_and_drops_slots_of_another_arena(tmp_path):
    path = tmp_path / "ledger.sqlite"
    led, _ = _ledger(path)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE) for _ in range(3)])
    ready, leased, submitted = (led.next_to_submit(10**9) for _ in range(3))
    led.on_notice(_ok(ready), A.PAGE)
    led.on_notice(_ok(leased), A.PAGE)
    held = led.lease_next(b"t", None)
    led.close()
    led2 = Ledger(path)
    slots2 = SlotAllocator(ARENA_ID, 64 * A.PAGE, quarantine_s=60.0)
    led2.attach_slots(slots2)
    rec = led2.recover(lambda f: False)
    # the leased one is produced again: its trainer had the slot's unchecked bytes in its hands
    assert rec == {"ready": 1, "regenerate": 1, "resubmitted": 1}
    others = [k for k in (ready.key, leased.key) if k != held.key]
    assert led2.get(held.key).state == State.queued and led2.get(others[0]).state == State.ready
    st = slots2.stats()
    assert st.slots == 1 and st.quarantined_bytes == 2 * A.PAGE  # the submitted one's writer may still write
    nxt = led2.next_to_submit(10**9)
    assert nxt.key == submitted.key and nxt.slot.generation > max(ready.slot.generation, leased.slot.generation)
    led2.close()
    # The sidecar made a new arena (another budget): those slots are gone, their samples produced again.
    led3 = Ledger(path)
    slots3 = SlotAllocator("cd" * 16, 64 * A.PAGE)
    led3.attach_slots(slots3)
    assert led3.recover(lambda f: False) == {"regenerate": 1, "resubmitted": 1}  # (the leased one is queued already)
    assert slots3.stats().slots == 0


def test_a_schema_3_ledger_is_upgraded_to_the_placement_column(tmp_path):
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    led.add_job([NewSample([1, 2, 3], None, None, 30)])
    led.close()
    db = sqlite3.connect(path)  # take the file back to schema 3: no slot (then placement) column
    db.execute("ALTER TABLE samples DROP COLUMN placement")
    db.execute("PRAGMA user_version = 3")
    db.commit()
    db.close()
    led = Ledger(path)
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    cols = {r[1] for r in led._db.execute("PRAGMA table_info(samples)")}
    assert "placement" in cols and "slot" not in cols  # schema 4's slot column, then 5's placement
    led.recover(lambda f: False)
    assert led.next_to_submit(10**9).slot is None  # files: no allocator attached


def test_a_schema_4_ledgers_slots_become_the_arenas_placements_and_are_kept(tmp_path):
    """Schema 5 (issue 42): the slot column is an opaque placement, ``<layout>:<its text>``. A
    schema-4 file's slots are the arena's: after the upgrade a READY sample keeps its slot, which
    recovery reserves again, and a new slot is written the same way."""
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    led.attach_slots(SlotAllocator(ARENA_ID, 64 * A.PAGE))
    led.recover(lambda f: False)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE) for _ in range(2)])
    ready = led.next_to_submit(10**9)
    led.on_notice(P.Notice(status=P.NoticeStatus.ok, request_id="r", key=ready.key, attempt=ready.attempt,
                           slot=ready.slot, num_tokens=3, nbytes=30), ready.slot.length)  # fmt: skip
    led.close()
    db = sqlite3.connect(path)  # back to schema 4: the slot column held the slot's JSON
    (text,) = db.execute("SELECT placement FROM samples WHERE placement IS NOT NULL").fetchone()
    assert text == "arena:" + ready.slot.model_dump_json()
    db.execute("ALTER TABLE samples RENAME COLUMN placement TO slot")
    db.execute("UPDATE samples SET slot = substr(slot, 7) WHERE slot IS NOT NULL")
    db.execute("PRAGMA user_version = 4")
    db.commit()
    db.close()
    led = Ledger(path)
    assert led._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    slots = SlotAllocator(ARENA_ID, 64 * A.PAGE)
    led.attach_slots(slots)
    assert led.recover(lambda f: False) == {"ready": 1}
    assert led.get(ready.key).slot == ready.slot and slots.stats().slots == 1  # reserved again
    assert led._db.execute("SELECT placement FROM samples WHERE placement IS NOT NULL").fetchone()[0] == text
    led.close()


def test_the_arena_file_is_kept_for_the_same_size_and_made_anew_for_another(tmp_path):
    P.claim_spool(tmp_path / "spool")
    spool = tmp_path / "spool"
    a, reused = open_arena(spool, 4 * MB)
    assert not reused and a.size == 4 * MB
    b, reused = open_arena(spool, 4 * MB)
    assert reused and b.id == a.id
    (spool / f"{A.ARENA_NAME}.123.new").write_bytes(b"x")  # a creation killed half-way
    c, reused = open_arena(spool, 8 * MB)
    assert not reused and c.id != a.id and not (spool / f"{A.ARENA_NAME}.123.new").exists()
    with pytest.raises(A.ArenaError):
        a.check(A.Slot(arena=c.id, offset=A.PAGE, length=A.PAGE, generation=1))
    for x in (a, b, c):
        x.close()


def test_a_sample_acked_before_its_received_keeps_its_slot_until_the_received(tmp_path):
    """``for x in stream`` acks a sample when the next is asked for, while x still views its slot:
    the slot stays taken after the ACK, and goes on the RECEIVED (or with the trainer)."""
    path = tmp_path / "ledger.sqlite"
    led, slots = _ledger(path, q=60.0)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE) for _ in range(2)])
    a, b = led.next_to_submit(10**9), led.next_to_submit(10**9)
    for s in (a, b):
        led.on_notice(_ok(s), A.PAGE)
    la, lb = led.lease_next(b"t", None), led.lease_next(b"t", None)
    assert led.ack(b"t", la.key, la.lease_token) and led.get(la.key).state == State.consumed
    assert slots.stats().slots == 2  # consumed, but its views may be alive: still taken
    assert led.received(b"other", la.key, la.lease_token) == 0  # not the trainer that holds it
    assert led.holds(la.key, la.lease_token) and not led.holds(la.key, "nope")
    assert led.received(b"t", la.key, la.lease_token) == A.PAGE
    assert slots.stats().slots == 1 and slots.stats().quarantined_bytes == 0
    assert led._store.load(la.key).slot is None
    # the second: acked, then the trainer goes away (killed with views): quarantined
    assert led.ack(b"t", lb.key, lb.lease_token)
    led.close()
    led2 = Ledger(path)  # ... and a restart in between: the row says the slot was held
    slots2 = SlotAllocator(ARENA_ID, 64 * A.PAGE, quarantine_s=60.0)
    led2.attach_slots(slots2)
    assert led2.recover(lambda f: False) == {"consumed_slots_quarantined": 1}
    st = slots2.stats()
    assert st.slots == 0 and st.quarantined_bytes == A.PAGE and led2._store.load(lb.key).slot is None


def test_a_trainer_gone_after_acking_gives_its_kept_slots_back_into_quarantine():
    led, slots = _ledger(q=60.0)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE)])
    s = led.next_to_submit(10**9)
    led.on_notice(_ok(s), A.PAGE)
    t = led.lease_next(b"t", None)
    assert led.ack(b"t", t.key, t.lease_token)
    led.release_owner(b"t", lambda f: False)
    st = slots.stats()
    assert st.slots == 0 and st.quarantined_bytes == A.PAGE


class _FailingJobsDb:
    """A sqlite connection whose first UPDATE of a job row fails (disk full, I/O error)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *a):  # noqa: ANN002, ANN201
        if sql.startswith("UPDATE jobs"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *a)


def test_a_slot_given_back_in_an_ack_list_that_rolls_back_stays_its_samples(tmp_path):
    """An ACK for a sample no one leases now (the trainer's lease went with it) gives its slot
    back; if that ACK message's transaction fails, the slot must still be the sample's, not free
    for the next submission while the sample, READY again, still names it."""
    led, slots = _ledger(tmp_path / "l.sqlite", q=60.0)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE) for _ in range(2)])
    s = led.next_to_submit(10**9)
    led.on_notice(_ok(s), A.PAGE)
    t = led.lease_next(b"t", None)
    led.unlease(b"t", [t.key], lambda f: False)  # READY again (its DELIVER never left), bytes in its slot
    real = led._db
    led._db = _FailingJobsDb(real)
    with pytest.raises(sqlite3.OperationalError):
        led.ack_many(b"t", [t.key], [t.lease_token])
    led._db = real
    again = led.get(t.key)
    assert again.state == State.ready and again.slot == t.notice.slot
    assert slots.stats().slots == 1  # still taken: the next sample gets another slot
    nxt = led.next_to_submit(10**9)
    assert nxt.slot.offset != t.notice.slot.offset
    assert led.ack_many(b"t", [t.key], [t.lease_token]) == (1, 0)  # applies whole later
    st = slots.stats()  # the lapsed trainer may still view it: quarantined, not reused at once
    assert st.slots == 1 and st.quarantined_bytes == A.PAGE and led.get(t.key).state == State.consumed


def test_a_slot_the_trainer_refused_waits_out_the_quarantine():
    """A FAIL (checksum mismatch, another attempt's header) may mean a late writer is still in
    the slot: it is not handed to the next sample at once."""
    led, slots = _ledger(q=60.0)
    led.add_job([NewSample([1, 2, 3], None, None, A.PAGE)])
    s = led.next_to_submit(10**9)
    led.on_notice(_ok(s), A.PAGE)
    t = led.lease_next(b"t", None)
    led.trainer_failed(b"t", t.key, t.lease_token, "checksum mismatch")
    st = slots.stats()
    assert st.slots == 0 and st.quarantined_bytes == A.PAGE
    assert led.get(t.key).state == State.queued and led.get(t.key).slot is None
