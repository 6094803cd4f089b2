"""Checked bytes are trained bytes (issue 40), the sidecar's half: a slot a trainer may still
view is never handed to another sample, whatever the sidecar believes about that trainer (gone
silent past its timeout, or unknown to a sidecar killed with SIGKILL and restarted), and a sample
whose trainer went away with it unchecked in its hands is produced again, never passed on.

Real arena files in /dev/shm, the real ledger (on SQLite) with the real slot allocator, samples
written into their slots by the connector's own writer (under its lease), trainers reading them
with the stream's own reader (its copy-on-write mapping and its holds), a real sidecar process
killed with SIGKILL. What the tests fill the arena with is what a busy sidecar would: every slot
the allocator hands out, written, read by another trainer and freed again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from connector import protocol as P
from connector.contract import arena as A
from connector.contract import sample_file as SF
from server.arena import SlotAllocator, open_arena
from server.ledger import Ledger, NewSample, State
from tests.support import sample_files as SFX
from trainer_client.sample_checks import load_and_check
from connector import layouts as L

T, LAYERS, HID = 12, [1, 2, 3], 32
LEN = SFX.slot_bytes(T, len(LAYERS), HID)
SLOTS = 6  # the arena holds this many samples
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def spool():
    with SFX.shm_spool() as d:
        P.claim_spool(d)
        yield d


def _sidecar(path: Path, arena: A.Arena, q: float = 0.0) -> tuple[Ledger, SlotAllocator]:
    """The sidecar's ledger and allocator on ``arena``, started (or restarted) as server/app.py does."""
    led = Ledger(path)
    slots = SlotAllocator(arena.id, arena.size, quarantine_s=q, arena=arena)
    led.attach_slots(slots)
    led.recover(lambda f: False)
    return led, slots


def _job(led: Ledger, n: int) -> None:
    led.add_job([NewSample([(7 * i + j) % 500 for j in range(T)], None, None, LEN) for i in range(n)])


def _produce(led: Ledger, spool: Path) -> list:
    """What the connector does for every sample the sidecar submits now (each one's values a
    function of its key, as a verifier's prefill is): its slot written, its notice applied."""
    out = []
    while (s := led.next_to_submit(10**12)) is not None:
        assert s.slot is not None
        w = SFX.write_sample(spool, key=s.key, attempt=s.attempt, slot=s.slot, seed=s.key.index,
                             token_ids=s.token_ids, layer_ids=LAYERS, hidden=HID)  # fmt: skip
        assert led.on_notice(w.notice, s.slot.length).name == "ready"
        out.append(s)
    return out


def _deliver(s) -> P.Deliver:  # noqa: ANN001
    return P.Deliver(notice=s.notice, expected_token_ids=s.token_ids, token=s.lease_token)


def _original(key: P.SampleKey) -> torch.Tensor:
    return SFX.random_hidden_states(T, len(LAYERS), HID, seed=key.index)


def _churn(led: Ledger, spool: Path, slots: SlotAllocator, rounds: int = 3) -> list[A.Slot]:
    """A busy sidecar beside the held slots: every sample it can submit is written, read by
    another trainer and RECEIVED (its slot freed and assigned again), ``rounds`` times over.
    Returns every slot handed out."""
    seen = []
    maps = L.Readers(spool)
    for _ in range(rounds):
        for s in _produce(led, spool):
            seen.append(s.slot)
        while (b := led.lease_next(b"B", None)) is not None:
            x = load_and_check(spool, _deliver(b), readers=maps)
            assert torch.equal(x.hidden_states, _original(b.key))
            del x
            led.received(b"B", b.key, b.lease_token)
            led.ack(b"B", b.key, b.lease_token)
    maps.close()
    return seen


def _overlaps(a: A.Slot, b: A.Slot) -> bool:
    return a.offset < b.end and b.offset < a.end


@pytest.mark.parametrize("how", ["in_place_op", "shared_mapping"])
def test_a_trainer_that_changed_its_sample_and_went_quiet_leaves_the_next_one_the_original_bytes(spool, tmp_path, how):
    """Issue 40: trainer A add_(1.0)'d its view and went quiet, and B was yielded A's modified
    bytes, unchecked. ``in_place_op``: as a training loop would (its private pages only now);
    ``shared_mapping``: through a writable shared mapping of the arena, as an older client or
    anything else of this user's could. Either way B gets the sample's own values: A's sample
    is produced again rather than handed on."""
    arena = SFX.make_arena(spool, A.PAGE + SLOTS * LEN)
    led, slots = _sidecar(tmp_path / "l.sqlite", arena)
    _job(led, 1)
    _produce(led, spool)
    a = led.lease_next(b"A", None)
    maps_a = L.Readers(spool)
    xa = load_and_check(spool, _deliver(a), readers=maps_a)
    if how == "in_place_op":
        xa.hidden_states.add_(1.0)
    else:
        SFX.read_slot_tensors(spool, a.notice.slot)[SF.HIDDEN_STATES_KEY].add_(1.0)
    led.release_owner(b"A", lambda f: False)  # silent past its timeout (or killed)
    _produce(led, spool)  # whatever the sidecar submits meanwhile
    b = led.lease_next(b"B", None)
    assert b is not None and b.key == a.key
    xb = load_and_check(spool, _deliver(b), readers=L.Readers(spool))
    assert torch.equal(xb.hidden_states, _original(a.key)), "B was given bytes A changed"
    del xa


def test_a_trainer_silent_past_its_timeout_keeps_its_views_bytes(spool, tmp_path):
    """Issue 40: a slot acknowledged by a trainer that still holds views of it was freed once
    the trainer had been silent past its timeout plus the quarantine, and reused: the trainer's
    tensors then held another sample's bytes. Its leased (not yet acked) sample's slot too."""
    arena = SFX.make_arena(spool, A.PAGE + SLOTS * LEN)
    led, slots = _sidecar(tmp_path / "l.sqlite", arena)  # quarantine 0: "past the quarantine" at once
    _job(led, 40)
    _produce(led, spool)
    maps = L.Readers(spool)
    acked, leased = led.lease_next(b"A", None), led.lease_next(b"A", None)
    views = [load_and_check(spool, _deliver(s), readers=maps).hidden_states for s in (acked, leased)]
    before = [v.clone() for v in views]
    held = [acked.notice.slot, leased.notice.slot]
    assert led.ack(b"A", acked.key, acked.lease_token)  # asked past it, views kept (no RECEIVED)
    led.release_owner(b"A", lambda f: False)  # then silent past its timeout
    handed = _churn(led, spool, slots)
    assert handed, "the churn assigned nothing: the test proves nothing"
    assert not [s for s in handed for h in held if _overlaps(s, h)], "a slot still viewed was assigned again"
    assert all(torch.equal(v, b) for v, b in zip(views, before, strict=True)), "the views' bytes changed"
    assert slots.stats().quarantined_bytes == 2 * LEN  # kept out of the free list meanwhile
    del views
    _churn(led, spool, slots, rounds=1)
    assert slots.stats().quarantined_bytes == 0  # let go: voided and free again


_KILLED_SIDECAR = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from connector import protocol as P
    from server.arena import SlotAllocator, open_arena
    from server.ledger import Ledger, NewSample
    spool, ledger, size, length, tokens = Path(sys.argv[1]), Path(sys.argv[2]), *map(int, sys.argv[3:6])
    arena, _ = open_arena(spool, size)
    led = Ledger(ledger)
    led.attach_slots(SlotAllocator(arena.id, arena.size, quarantine_s=0.0, arena=arena))
    led.recover(lambda f: False)
    led.add_job([NewSample([(7 * i + j) % 500 for j in range(tokens)], None, None, length) for i in range(3)])
    rows = [led.next_to_submit(10**12) for _ in range(3)]
    print(json.dumps([[r.key.model_dump(mode="json"), r.attempt, r.slot.model_dump(mode="json"), r.token_ids]
                      for r in rows]), flush=True)
    for line in sys.stdin.readline().split("|"):  # the connector wrote them: their notices
        n = P.Notice.model_validate_json(line)
        assert led.on_notice(n, n.slot.length).name == "ready"
    rows = [led.lease_next(b"A", None) for _ in range(3)]
    print(json.dumps([P.Deliver(notice=s.notice, expected_token_ids=s.token_ids, token=s.lease_token).model_dump(
        mode="json") for s in rows]), flush=True)
    sys.stdin.readline()  # the trainer read them: it acks the first, as `for x in stream` does
    assert led.ack(b"A", rows[0].key, rows[0].lease_token)
    print("acked", flush=True)
    sys.stdin.readline()  # killed before it gets here
    """
)


def test_a_sidecar_killed_and_restarted_keeps_every_slot_a_live_trainer_views(spool, tmp_path):
    """Issue 40: after any sidecar restart the slots of a trainer that kept heart-beating with
    views held were freed (an acked one's at once, a leased one's once another trainer had it)
    and reused. The sidecar keeps no record of what is viewed: the trainer's read locks are the
    kernel's, and the restarted sidecar finds them. (The sidecar process: its ledger, allocator
    and leases on the ledger file, as server/app.py runs them; the connector's writes are made
    here, by its own writer.)"""
    ledger = tmp_path / "l.sqlite"
    size = A.PAGE + SLOTS * LEN
    p = subprocess.Popen([sys.executable, "-c", _KILLED_SIDECAR, str(spool), str(ledger), str(size), str(LEN), str(T)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})  # fmt: skip

    def say(line: str) -> None:
        p.stdin.write(line + "\n")
        p.stdin.flush()

    try:
        notices = []
        for key, attempt, slot, ids in json.loads(p.stdout.readline()):
            k = P.SampleKey.model_validate(key)
            notices.append(SFX.write_sample(spool, key=k, attempt=attempt, slot=A.Slot.model_validate(slot),
                                            seed=k.index, token_ids=ids, layer_ids=LAYERS, hidden=HID).notice)  # fmt: skip
        say("|".join(n.model_dump_json() for n in notices))
        ds = [P.Deliver.model_validate(d) for d in json.loads(p.stdout.readline())]
        maps = L.Readers(spool)  # the trainer: heart-beating all along, its views kept
        views = [load_and_check(spool, d, readers=maps).hidden_states for d in ds]
        before = [v.clone() for v in views]
        say("read")
        assert p.stdout.readline().strip() == "acked"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdin.close()
        p.stdout.close()
    arena, reused = open_arena(spool, size)  # restarted: the same arena, its ledger recovered
    assert reused
    led, slots = _sidecar(ledger, arena)
    lapsed = [led.get(d.notice.key).state for d in ds[1:]]
    _job(led, 40)
    handed = _churn(led, spool, slots)
    held = [d.notice.slot for d in ds]
    assert handed and not [s for s in handed for h in held if _overlaps(s, h)], "a slot still viewed was reassigned"
    assert all(torch.equal(v, b) for v, b in zip(views, before, strict=True)), "the views' bytes changed"
    assert set(lapsed) <= {State.queued}  # its leases lapsed with the restart: produced again, not handed on
    del views
    _churn(led, spool, slots, rounds=1)
    assert slots.stats().quarantined_bytes == 0


def test_a_restarted_sidecar_keeps_out_a_range_its_ledger_gave_up_while_a_trainer_still_reads_it(spool):
    """What the ledger cannot know (a slot it freed while a lapsed trainer still viewed it, then
    a crash): a restarted sidecar asks the kernel which of its free ranges are still locked."""
    arena = SFX.make_arena(spool, A.PAGE + SLOTS * LEN)
    first = SlotAllocator(arena.id, arena.size, arena=arena)
    s = first.alloc(LEN)
    w = SFX.write_sample(spool, key=P.SampleKey(job="j", index=0), slot=s, seed=0, tokens=T, layer_ids=LAYERS,
                         hidden=HID)  # fmt: skip
    maps = L.Readers(spool)
    view = load_and_check(spool, w.deliver, readers=maps).hidden_states
    after = SlotAllocator(arena.id, arena.size, arena=arena)  # a restart whose ledger holds no slot
    assert after.void_stale_claims() == 0 and after.held_at_restart == 1
    assert after.stats().quarantined_bytes == LEN
    got = []
    while (x := after.alloc(A.PAGE)) is not None:
        got.append(x)
    assert len(got) == SLOTS * LEN // A.PAGE - LEN // A.PAGE  # every other page
    assert not [x for x in got if _overlaps(x, s)], "a range a trainer still views was handed out"
    for x in got:
        after.free(x)
    del view
    assert after.stats().quarantined_bytes == 0 and after.stats().largest_free == arena.size - A.PAGE


_READER = textwrap.dedent(
    """
    import sys, time
    from connector.contract import arena as A
    a = A.Arena.open(sys.argv[1], private=True)
    a.reads.take(A.Slot(arena=a.id, offset=int(sys.argv[2]), length=int(sys.argv[3]), generation=1))
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_trainers_holds_go_with_it(spool):
    arena = SFX.make_arena(spool, A.PAGE + SLOTS * LEN)
    slot = SFX.slot_for(arena, A.PAGE, LEN, generation=3)
    p = subprocess.Popen([sys.executable, "-c", _READER, str(spool), str(slot.offset), str(slot.length)],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})  # fmt: skip
    try:
        assert p.stdout.readline().strip() == "held"
        assert not arena.void(slot)  # a reader in another process holds it
        assert arena.held_ranges(A.PAGE, arena.size) == [(slot.offset, slot.length)]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert arena.void(slot) and arena.held_ranges(A.PAGE, arena.size) == []  # its lock went with it
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
