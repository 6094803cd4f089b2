"""Who may write a slot (``connector/contract/arena.py``): the sidecar's claim, the writer's
lease (an open-file-description lock on the slot's bytes) and the void that ends both. With real
arena files in a real tmpfs, real locks, and a real writer process killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from connector.contract import arena as A
from server.arena import SlotAllocator
from tests.support import sample_files as SFX

LEN = 4 * A.PAGE


@pytest.fixture
def spool():
    """A spool in shared memory, as the arena's always is (removed after the test)."""
    with tempfile.TemporaryDirectory(prefix="hss-lease-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        yield d


def test_a_writer_gets_the_lease_only_while_its_claim_is_there(spool):
    arena = SFX.make_arena(spool, 64 * A.PAGE)
    slot = SFX.slot_for(arena, A.PAGE, LEN, generation=7)
    lease = arena.lease(slot)  # the control: its own claim
    lease.release()
    lease.release()  # idempotent
    with pytest.raises(A.SlotReassigned):
        arena.lease(slot.model_copy(update={"generation": 6}))  # an older assignment of the same bytes
    assert arena.void(slot)
    with pytest.raises(A.SlotReassigned, match="no longer claimed"):
        arena.lease(slot)  # given up: never granted again
    later = SFX.slot_for(arena, A.PAGE, 2 * LEN, generation=8)  # the bytes assigned anew
    with pytest.raises(A.SlotReassigned):
        arena.lease(slot)
    arena.lease(later).release()


def test_a_slot_cannot_be_voided_while_its_writer_holds_the_lease(spool):
    arena = SFX.make_arena(spool, 64 * A.PAGE)
    slot = SFX.slot_for(arena, A.PAGE, LEN, generation=3)
    lease = arena.lease(slot)
    assert not arena.void(slot)  # still writing: nothing changed
    assert not arena.void(slot.model_copy(update={"length": A.PAGE}))  # its first page alone, as after a restart
    assert bytes(arena.map[slot.offset + A.CLAIM_AT : slot.offset + A.CLAIM_AT + A.CLAIM_LEN]) == A.claim_bytes(3)
    lease.release()
    assert arena.void(slot)
    assert bytes(arena.map[slot.offset : slot.offset + A.CLAIM_AT + A.CLAIM_LEN]) == bytes(A.CLAIM_AT + A.CLAIM_LEN)


def test_two_writers_of_overlapping_slots_in_one_process_exclude_each_other(spool):
    """Open-file-description locks, not POSIX record locks (which never conflict within one
    process): a late write and a new one in the same vLLM worker must not interleave."""
    arena = SFX.make_arena(spool, 64 * A.PAGE)
    old = SFX.slot_for(arena, A.PAGE, LEN, generation=1)
    held = arena.lease(old)
    new = SFX.slot_for(arena, A.PAGE + 2 * A.PAGE, LEN, generation=2)  # overlaps old's last two pages
    t0 = time.monotonic()
    with pytest.raises(A.SlotBusy):
        arena.lease(new, wait_s=0.2)
    assert time.monotonic() - t0 >= 0.2
    held.release()
    arena.lease(new, wait_s=0.2).release()  # the control: free once the other let go


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from connector.contract import arena as A
    a = A.Arena.open(sys.argv[1])
    slot = A.Slot(arena=a.id, offset=int(sys.argv[2]), length=int(sys.argv[3]), generation=int(sys.argv[4]))
    lease = a.lease(slot)
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_writer_leaves_no_lock_behind(spool):
    arena = SFX.make_arena(spool, 64 * A.PAGE)
    slot = SFX.slot_for(arena, A.PAGE, LEN, generation=9)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(spool), str(slot.offset), str(slot.length), "9"],
                         stdout=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [root, *filter(None, [os.environ.get("PYTHONPATH")])])})  # fmt: skip
    try:
        assert p.stdout.readline().strip() == "held"
        assert not arena.void(slot)  # a writer in another process holds it
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert arena.void(slot)  # its lock went with it
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def test_a_released_lease_is_unlocked_though_a_forked_child_still_holds_its_descriptor(spool):
    """A worker that forks while it holds a lease (a fork-started pool) shares the lock's
    description with the child: closing the parent's descriptor alone would leave the slot locked,
    and unvoidable, for the child's life."""
    arena = SFX.make_arena(spool, 64 * A.PAGE)
    slot = SFX.slot_for(arena, A.PAGE, LEN, generation=5)
    lease = arena.lease(slot)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds the inherited descriptors until the parent lets it go
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        assert not arena.void(slot)  # the control: locked while the lease is held
        lease.release()
        assert arena.void(slot)
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def test_the_allocator_claims_voids_and_keeps_a_slot_still_being_written_out_of_the_free_list(spool):
    arena = SFX.make_arena(spool, 16 * A.PAGE)
    alloc = SlotAllocator(arena.id, arena.size, quarantine_s=0.0, arena=arena)
    s1 = alloc.alloc(LEN)
    assert bytes(arena.map[s1.offset + A.CLAIM_AT : s1.offset + A.CLAIM_AT + A.CLAIM_LEN]) == A.claim_bytes(s1.generation)
    lease = arena.lease(s1)  # its writer is at it
    alloc.free(s1, quarantine=False)  # e.g. its request timed out
    st = alloc.stats()
    assert st.slots == 0 and st.quarantined_bytes == LEN and st.free_bytes == arena.size - A.PAGE - LEN
    s2 = alloc.alloc(LEN)
    assert s2.offset != s1.offset  # not handed out while it is written
    lease.release()
    assert alloc.stats().quarantined_bytes == 0  # voided at the next look, then free
    with pytest.raises(A.SlotReassigned):
        arena.lease(s1)  # the late writer of s1 is refused
    s3 = alloc.alloc(LEN)
    assert s3.offset == s1.offset and s3.generation > s2.generation
    arena.lease(s3).release()


def test_a_restart_voids_the_claims_the_ledger_does_not_hold(spool):
    arena = SFX.make_arena(spool, 32 * A.PAGE)
    before = SlotAllocator(arena.id, arena.size, arena=arena)
    kept, lost, busy = before.alloc(LEN), before.alloc(LEN), before.alloc(LEN)
    held = arena.lease(busy)  # a writer of a lost assignment still writing through the restart
    after = SlotAllocator(arena.id, arena.size, arena=arena, generation=busy.generation)
    assert after.reserve(kept)  # what the ledger holds
    assert after.void_stale_claims() == 2
    with pytest.raises(A.SlotReassigned):
        arena.lease(lost)
    arena.lease(kept).release()  # its own claim is kept
    st = after.stats()
    assert st.slots == 1 and st.quarantined_bytes == LEN  # busy's whole lease waits for its writer
    while (s := after.alloc(A.PAGE)) is not None:  # nothing handed out overlaps the writer's bytes
        assert s.end <= busy.offset or s.offset >= busy.end
    held.release()
    assert after.stats().quarantined_bytes == 0 and after.stats().free_bytes == LEN  # voided, then free
    with pytest.raises(A.SlotReassigned):
        arena.lease(busy)


def test_the_writer_refuses_a_slot_given_up_before_it_wrote(spool):
    arena = SFX.make_arena(spool, 256 * A.PAGE, fill=0xA5)
    slot = SFX.slot_for(arena, A.PAGE, SFX.slot_bytes(11, 3, 32), generation=4)
    assert arena.void(slot)
    before = bytes(arena.map)
    with pytest.raises(RuntimeError, match="no longer claimed"):
        SFX.write_sample(spool, tokens=11, layer_ids=[1, 2, 3], hidden=32, slot=slot)
    assert bytes(arena.map) == before  # not one byte written
