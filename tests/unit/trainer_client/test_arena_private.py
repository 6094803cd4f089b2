"""Checked bytes are trained bytes (issue 40), the trainer's half: what the stream yields from an
arena slot is a view of this trainer's copy-on-write mapping, so an in-place op (an ``add_``, a
normalisation) changes its own pages and never the shared slot; the slot is held (a read lock on
its bytes) from before its header is read until its last view goes; a slot bound for a CUDA
device is copied out (a private mapping cannot be page-locked); and a file's sample is private
too. Real arena files in /dev/shm, real locks, a real forked child. (The sidecar's half, and the
scenarios of issue 40 end to end: tests/unit/server/test_arena_holds.py.)"""

from __future__ import annotations

import os
import time

import pytest
import torch

from connector import protocol as P
from connector.contract import arena as A
from connector.contract import sample_file as SF
from tests.support import sample_files as SFX
from tests.unit.trainer_client.test_stream_pool import FakeSidecar
from trainer_client import HiddenStateStream
from trainer_client.sample_checks import load_and_check
from connector import layouts as L
from trainer_client.sample_reader import ArenaMaps, SlotNotReadable, read_sample_file, slot_is_copied

T, LAYERS, HID = 12, [1, 2, 3], 32
LEN = SFX.slot_bytes(T, len(LAYERS), HID)


@pytest.fixture
def spool():
    with SFX.shm_spool() as d:
        yield d


def _write(spool, arena, i=0, *, offset=None, gen=1, seed=None):  # noqa: ANN001, ANN202
    slot = SFX.slot_for(arena, offset if offset is not None else A.PAGE + i * LEN, LEN, gen)
    return SFX.write_sample(spool, key=P.SampleKey(job="j", index=i), seed=i if seed is None else seed, tokens=T,
                            layer_ids=LAYERS, hidden=HID, slot=slot)  # fmt: skip


def _shared(spool, w):  # noqa: ANN001, ANN202
    """The slot's hidden states as the arena holds them (a fresh shared mapping: what any other reader sees)."""
    return SFX.read_slot_tensors(spool, w.notice.slot)[SF.HIDDEN_STATES_KEY]


def test_an_in_place_op_on_what_the_stream_yields_never_reaches_the_shared_slot(tmp_path, spool):
    """Issue 40: a trainer that normalised or add_'ed a yielded tensor in place changed the slot
    itself (a view of a shared writable mapping), for whoever read it next, unchecked."""
    arena = SFX.make_arena(spool)
    w = _write(spool, arena)
    sc = FakeSidecar(tmp_path, [w.deliver], end=False)
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=spool, credit=2, timeout_s=20, idle_s=0.05) as s:
            x = next(v for v in s if v is not None)
            base = torch.frombuffer(s._readers.get("arena").maps()._arena.map, dtype=torch.uint8).data_ptr()  # noqa: SLF001
            assert base <= x.hidden_states.data_ptr() < base + arena.size  # a view of the slot: no copy
            x.hidden_states.add_(1.0)  # what a loop may do: no SIGSEGV (a writable mapping) ...
            x.hidden_states.div_(x.hidden_states.float().norm().to(x.hidden_states.dtype))
            x.token_ids.zero_()
            assert not torch.equal(x.hidden_states, w.hidden_states)  # ... its own pages changed ...
            assert torch.equal(_shared(spool, w), w.hidden_states), "the shared slot changed"  # ... not the slot
            other = load_and_check(spool, w.deliver, readers=L.Readers(spool))  # another trainer reads it
            assert torch.equal(other.hidden_states, w.hidden_states) and torch.equal(other.token_ids, w.token_ids)
            del x, other
    finally:
        sc.stop()


def test_a_slot_is_held_while_a_view_of_it_lives_and_let_go_with_the_last(spool):
    arena = SFX.make_arena(spool)
    w = _write(spool, arena)
    slot, released = w.notice.slot, []
    maps = L.Readers(spool)
    x = load_and_check(spool, w.deliver, readers=maps, on_release=lambda: released.append(arena.void(slot)))
    hs, ids = x.hidden_states, x.token_ids
    del x
    assert not arena.void(slot) and not released  # the sidecar's void is refused: a reader holds it
    assert arena.held_ranges(A.PAGE, arena.size) == [(slot.offset, slot.length)]
    del hs
    assert not arena.void(slot) and not released  # the token ids are a view of it too
    del ids
    assert released == [True]  # let go before the caller hears of it (its RECEIVED)
    assert arena.held_ranges(A.PAGE, arena.size) == []


def test_letting_go_drops_the_private_pages_so_the_next_sample_there_is_read_anew(spool):
    """A copy-on-write page this trainer wrote is its own: kept, it would be read instead of the
    next sample written into those bytes (no checksum would notice)."""
    arena = SFX.make_arena(spool)
    first = _write(spool, arena, 0)
    maps = L.Readers(spool)
    x = load_and_check(spool, first.deliver, readers=maps)
    x.hidden_states.add_(1.0)
    del x
    assert arena.void(first.notice.slot)  # freed, assigned again to another sample, written
    second = _write(spool, arena, 0, gen=2, seed=99)
    y = load_and_check(spool, second.deliver, readers=maps)  # the same trainer, the same mapping
    assert torch.equal(y.hidden_states, second.hidden_states), "read its own stale pages"
    assert 0 < maps.get("arena").maps()._arena.reads.scrubbed_pages < LEN // A.PAGE  # noqa: SLF001  # only the pages it wrote


def test_a_forked_child_never_lets_go_of_its_parents_holds(spool):
    """A fork-started worker (a DataLoader's) inherits the views and the hold's description: its
    copy of a view dying must not unlock the parent's slot."""
    arena = SFX.make_arena(spool)
    w = _write(spool, arena)
    x = load_and_check(spool, w.deliver, readers=L.Readers(spool))
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the sample: its finalizer runs here
        code = 1
        try:
            del x
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not arena.void(w.notice.slot), "the child's finalizer unlocked the parent's slot"
    del x
    assert arena.void(w.notice.slot)


def test_holds_are_counted_per_slot_and_an_overlapping_one_never_unlocks_anothers_bytes(spool):
    """One description's locks merge: a slot held twice, or a stale delivery overlapping a held
    slot and let go at once, must leave the held bytes locked."""
    arena = SFX.make_arena(spool)
    maps = L.Readers(spool)
    reads = maps.get("arena").maps().get(SFX.slot_for(arena, A.PAGE, A.PAGE)).reads
    held = A.Slot(arena=arena.id, offset=2 * A.PAGE, length=2 * A.PAGE, generation=1)
    stale = A.Slot(arena=arena.id, offset=A.PAGE, length=3 * A.PAGE, generation=2)  # covers held, and a page before
    reads.take(held)
    reads.take(held)
    reads.release(held)
    assert not arena.void(held)  # one hold left
    reads.take(stale)
    reads.release(stale)
    assert arena.held_ranges(A.PAGE, arena.size) == [(held.offset, held.length)], "an overlapping hold's let-go unlocked held bytes"
    assert arena.void(A.Slot(arena=arena.id, offset=A.PAGE, length=A.PAGE, generation=1))  # stale's own page: free
    assert not arena.void(held)
    reads.release(held)
    assert arena.void(held) and reads.holds() == 0


def test_a_stale_delivery_of_a_slot_being_written_anew_is_not_received(spool):
    arena = SFX.make_arena(spool)
    w = _write(spool, arena)
    assert arena.void(w.notice.slot)
    lease = arena.lease(SFX.slot_for(arena, A.PAGE, LEN, generation=2))  # assigned again, its writer at it
    try:
        t0 = time.monotonic()
        with pytest.raises(SlotNotReadable, match="write-locked"):
            load_and_check(spool, w.deliver, readers=L.Readers(spool))
        assert time.monotonic() - t0 >= A.READ_WAIT_S
    finally:
        lease.release()


def test_a_slot_bound_for_a_cuda_device_is_copied_out_at_once_and_never_page_locked(spool):
    """Page-locking a copy-on-write mapping (cudaHostRegister) would make every page this
    process's own copy: the slot goes to a CUDA device from a pinned copy instead, and is let go
    at once. The decision and the copy, on the CPU (the device half: the GPU issue's run)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert slot_is_copied(cuda, False) and slot_is_copied(cuda, True) and slot_is_copied(None, True)
    assert not slot_is_copied(None, False) and not slot_is_copied(cpu, False)
    assert not hasattr(ArenaMaps, "register_cuda")
    arena = SFX.make_arena(spool)
    w = _write(spool, arena)
    released, tm = [], {}
    x = load_and_check(spool, w.deliver, readers=L.Readers(spool), pin_memory=True, timings=tm,
                       alloc=lambda n: torch.empty(n, dtype=torch.uint8), on_release=lambda: released.append(1))  # fmt: skip
    assert released == [1] and arena.void(w.notice.slot)  # let go while the sample lives
    assert tm["bytes_copied"] > 0 and torch.equal(x.hidden_states, w.hidden_states)


def test_a_files_sample_is_private_to_its_trainer_too(spool):
    """The files layout: safetensors maps a file copy-on-write, and the stream renames it out of
    the spool before it yields it: an in-place op changes nothing another reader could see."""
    f = SFX.write_sample(spool, "hs-0.safetensors", key=P.SampleKey(job="j", index=0), tokens=T, layer_ids=LAYERS,
                         hidden=HID)  # fmt: skip
    before = f.path.read_bytes()
    t = read_sample_file(f.path)
    t[SF.HIDDEN_STATES_KEY].add_(1.0)
    assert f.path.read_bytes() == before
