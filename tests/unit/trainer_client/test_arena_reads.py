"""The arena layout on the trainer's side, without a sidecar: a slot the connector's writer filled
is read in place (its tensors are views of the mapping), checked like a file (torn header, another
attempt's generation, checksum), refused as not received when this trainer cannot reach it, and
its RECEIVED goes only once no view of it is alive (its ACK as for a file: the sidecar keeps a
consumed sample's slot until the RECEIVED). (The sidecar's slot allocation and the whole path
through it: tests/unit/server/test_arena_slots.py and the integration tests.)"""

from __future__ import annotations

import gc
import time
import weakref

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
from trainer_client.sample_reader import SlotNotReadable

T, LAYERS, HID = 12, [1, 2, 3], 32


@pytest.fixture
def spool(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    return d


def _slot_sample(spool, arena, i=0, *, offset=None, dtype="bfloat16", gen=1, **kw):
    length = SFX.slot_bytes(T, len(LAYERS), HID, dtype)
    slot = SFX.slot_for(arena, offset if offset is not None else A.PAGE + i * length, length, gen)
    return SFX.write_sample(spool, key=P.SampleKey(job="j", index=i), seed=i, tokens=T, layer_ids=LAYERS, hidden=HID,
                            dtype=dtype, slot=slot, **kw)  # fmt: skip


def _in_arena(t: torch.Tensor, arena: A.Arena) -> bool:
    base = torch.frombuffer(arena.map, dtype=torch.uint8).data_ptr()
    return base <= t.data_ptr() < base + arena.size


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_slot_reads_back_in_place_identical_to_the_file_layout(spool, dtype):
    arena = SFX.make_arena(spool)
    sf = _slot_sample(spool, arena, dtype=dtype)
    assert sf.notice.file is None and sf.notice.slot is not None
    as_file = SFX.write_sample(spool, "hs-f.safetensors", key=P.SampleKey(job="j", index=0), seed=0, tokens=T,
                               layer_ids=LAYERS, hidden=HID, dtype=dtype)  # fmt: skip
    tm: dict = {}
    released = []
    maps = L.Readers(spool)
    s = load_and_check(spool, sf.deliver, readers=maps, on_release=lambda: released.append(1), timings=tm)
    arena = maps.get("arena").maps()._arena  # the reader's own mapping
    assert torch.equal(s.hidden_states.view(torch.uint8), as_file.hidden_states.view(torch.uint8))  # the same bytes
    assert torch.equal(s.token_ids, as_file.token_ids)
    assert _in_arena(s.hidden_states, arena) and not released  # zero-copy: a view of the slot, held
    assert tm["bytes_copied"] == 0
    if dtype == "float8_e4m3fn":
        assert s.scales is not None and _in_arena(s.scales, arena)
        assert torch.equal(s.scales, SFX.read_slot_tensors(spool, sf.notice.slot)["hidden_states_scales"])


def test_a_torn_slot_is_invalid(spool):
    arena = SFX.make_arena(spool)
    sf = _slot_sample(spool, arena)
    arena.map[sf.notice.slot.offset : sf.notice.slot.offset + 8] = bytes(8)  # the writer's first step, never its last
    with pytest.raises(SF.InvalidSample, match="not .completely. written"):
        load_and_check(spool, sf.deliver, readers=L.Readers(spool))


def test_a_header_of_another_generation_is_invalid(spool):
    arena = SFX.make_arena(spool)
    sf = _slot_sample(spool, arena, offset=A.PAGE, gen=1)
    later = sf.notice.slot.model_copy(update={"generation": 2})  # reassigned since: delivered as generation 2
    d = sf.deliver.model_copy(update={"notice": sf.notice.model_copy(update={"slot": later})})
    with pytest.raises(SF.InvalidSample, match="another write"):
        load_and_check(spool, d, readers=L.Readers(spool))
    ok = _slot_sample(spool, arena, offset=A.PAGE, gen=2)  # the control: the same generation passes
    load_and_check(spool, ok.deliver, readers=L.Readers(spool))


@pytest.mark.parametrize("field,value", [("checksum", "0" * 32), ("finite", None), ("num_tokens", T - 1)])
def test_a_delivery_that_says_other_than_the_slots_header_is_invalid(spool, field, value):
    """No checksum of a trusted slot: the delivery's word on its bytes (checksum, the writer's
    finiteness verdict, the token count) must be the header's, written beside them."""
    arena = SFX.make_arena(spool)
    sf = _slot_sample(spool, arena, algo="xxh3-128")  # a writer that gives its finiteness verdict
    assert sf.notice.finite is True
    load_and_check(spool, sf.deliver, readers=L.Readers(spool))  # the control: as written, it passes
    d = sf.deliver.model_copy(update={"notice": sf.notice.model_copy(update={field: value})})
    with pytest.raises(SF.InvalidSample, match=f"{field} .* differs"):
        load_and_check(spool, d, readers=L.Readers(spool))


def test_a_slot_is_trusted_without_a_checksum_unless_verify_slots(spool):
    """By default a slot read in place takes no checksum (its lease keeps every other writer
    out): a bit flipped behind the writer's back is not seen, and no checksum time is spent.
    ``verify_slots`` takes it and refuses the slot."""
    arena = SFX.make_arena(spool)
    sf = _slot_sample(spool, arena, corrupt="checksum")
    tm: dict = {}
    s = load_and_check(spool, sf.deliver, readers=L.Readers(spool), timings=tm)
    assert "checksum_s" not in tm and s.hidden_states.shape == (T, len(LAYERS), HID)
    with pytest.raises(SF.InvalidSample, match="checksum"):
        load_and_check(spool, sf.deliver, readers=L.Readers(spool), verify_slots=True)
    tm = {}
    good = _slot_sample(spool, arena, 1)
    load_and_check(spool, good.deliver, readers=L.Readers(spool), verify_slots=True, timings=tm)
    assert tm["checksum_s"] > 0  # the control: verified, and it passes


def test_a_slot_the_writer_found_non_finite_is_refused_without_a_checksum(spool):
    arena = SFX.make_arena(spool)
    sf = _slot_sample(spool, arena, corrupt="nan")
    with pytest.raises(SF.InvalidSample, match="non-finite"):
        load_and_check(spool, sf.deliver, readers=L.Readers(spool))
    with pytest.raises(SF.InvalidSample, match="non-finite"):  # scanned again: still there
        load_and_check(spool, sf.deliver, readers=L.Readers(spool), rescan_finite=True)


def test_a_slot_past_the_arena_or_of_another_arena_is_not_readable(spool):
    arena = SFX.make_arena(spool, 64 * A.PAGE)
    sf = _slot_sample(spool, arena)
    past = sf.notice.slot.model_copy(update={"offset": 64 * A.PAGE})
    other = sf.notice.slot.model_copy(update={"arena": "0" * 32})
    for slot in (past, other):
        d = sf.deliver.model_copy(update={"notice": sf.notice.model_copy(update={"slot": slot})})
        with pytest.raises(SlotNotReadable):
            load_and_check(spool, d, readers=L.Readers(spool))


def test_pinned_reads_copy_the_slot_out_and_release_it_at_once(spool):
    arena = SFX.make_arena(spool)
    sf = _slot_sample(spool, arena)
    released, tm = [], {}
    maps = L.Readers(spool)
    s = load_and_check(spool, sf.deliver, readers=maps, pin_memory=True,
                       alloc=lambda n: torch.empty(n, dtype=torch.uint8),
                       on_release=lambda: released.append("gone"), timings=tm)  # fmt: skip
    assert not _in_arena(s.hidden_states, maps.get("arena").maps()._arena)
    assert tm["bytes_copied"] == A.written_size(arena.map[A.PAGE : 2 * A.PAGE], sf.notice.slot.length)
    assert released == ["gone"]  # while the sample lives: nothing of it is in the slot


# ------------------------------------------------------------------------------ the stream


def _stream(sc, spool, **kw):
    return HiddenStateStream(sc.endpoint, spool_dir=spool, credit=4, timeout_s=20, idle_s=0.05, **kw)


def _said(sc) -> list[tuple[str, P.SampleKey]]:
    return [(type(m).__name__, k) for m in list(sc.got) if isinstance(m, (P.Received, P.Ack)) for k in m.keys]


def _until(pred, it, limit=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        x = next(it)
        if pred():
            return x
    raise AssertionError("timed out")


def test_received_waits_for_the_views_and_the_ack_does_not(tmp_path, spool):
    arena = SFX.make_arena(spool)
    ds = [_slot_sample(spool, arena, i).deliver for i in range(2)]
    sc = FakeSidecar(tmp_path, ds, end=False)
    try:
        with _stream(sc, spool) as s:
            it = iter(s)
            first = next(it)
            while first is None:
                first = next(it)
            keys = [first.key]  # in the order checked, which is not always the delivery order
            held = first.hidden_states  # the loop keeps a view of the first sample's slot
            del first
            gc.collect()
            second = next(it)
            while second is None:
                second = next(it)
            keys.append(second.key)
            for _ in range(10):  # the stream runs (acks the first: ack="use"), the view lives
                assert next(it) is None
            # Asked past it: acked as for a file (a `for x in stream` loop holds x while asking),
            # but its bytes are still in use: no RECEIVED, and the sidecar keeps the slot.
            assert ("Ack", keys[0]) in _said(sc) and ("Received", keys[0]) not in _said(sc)
            assert s.slots_held == 2
            del held
            gc.collect()
            _until(lambda: ("Received", keys[0]) in _said(sc), it)
            said = _said(sc)
            assert ("Received", keys[1]) not in said  # the loop still holds the second
            del second
            gc.collect()
            _until(lambda: ("Received", keys[1]) in _said(sc), it)
        time.sleep(0.2)
    finally:
        sc.stop()
    assert s.stats["yielded"] == 2 and s.stats["bytes_copied"] == 0
    assert sorted(p.name for p in spool.iterdir() if not p.name.startswith(".hsstream-arena")) == []  # nothing made
    assert (spool / A.ARENA_NAME).exists()  # nor removed


def test_a_dequantized_fp8_slot_is_released_when_it_is_decoded(tmp_path, spool):
    arena = SFX.make_arena(spool)
    d = _slot_sample(spool, arena, dtype="float8_e4m3fn").deliver
    sc = FakeSidecar(tmp_path, [d], end=False)
    try:
        with _stream(sc, spool) as s:
            it = iter(s)
            x = next(it)
            while x is None:
                x = next(it)
            assert x.hidden_states.dtype == torch.bfloat16 and not _in_arena(x.token_ids, arena)
            _until(lambda: ("Received", d.notice.key) in _said(sc), it)  # while the loop holds the sample
            assert s.stats["bytes_copied"] == 8 * T  # the token ids copied out
    finally:
        sc.stop()


def test_an_unreachable_slot_is_failed_as_not_received(tmp_path, spool):
    arena = SFX.make_arena(spool)
    sf = _slot_sample(spool, arena)
    d = sf.deliver.model_copy(update={"notice": sf.notice.model_copy(update={"slot": sf.notice.slot.model_copy(
        update={"arena": "0" * 32})})})  # fmt: skip
    sc = FakeSidecar(tmp_path, [d], end=False)
    try:
        with _stream(sc, spool) as s:
            it = iter(s)
            _until(lambda: bool(sc.of(P.Fail)), it)
    finally:
        sc.stop()
    (f,) = sc.of(P.Fail)
    assert f.not_received and f.key == d.notice.key
    assert s.stats["not_received"] == 1 and s.stats["invalid"] == 0 and not sc.of(P.Received)


def test_an_invalid_slot_is_failed_and_never_received(tmp_path, spool):
    arena = SFX.make_arena(spool)
    d = _slot_sample(spool, arena, corrupt="checksum").deliver
    sc = FakeSidecar(tmp_path, [d], end=False)
    try:
        with _stream(sc, spool, verify_slots=True) as s:
            it = iter(s)
            _until(lambda: bool(sc.of(P.Fail)), it)
            gc.collect()
            for _ in range(5):
                next(it)
    finally:
        sc.stop()
    (f,) = sc.of(P.Fail)
    assert not f.not_received and "checksum" in f.reason and not sc.of(P.Received)


def test_the_trainer_copies_no_more_for_a_slot_than_for_a_file(tmp_path, spool):
    """Same sample, same settings: unpinned both are read in place (0 bytes: safetensors maps the
    file); into (here unpinned) host buffers, as for a GPU, both copy the sample once."""
    arena = SFX.make_arena(spool)
    slot = _slot_sample(spool, arena)
    file = SFX.write_sample(spool, "hs-f.safetensors", key=P.SampleKey(job="j", index=0), seed=0, tokens=T,
                            layer_ids=LAYERS, hidden=HID)  # fmt: skip
    got = {}
    cases = (("slot", slot, False), ("file", file, False), ("slot_p", slot, True), ("file_p", file, True))
    for name, sample, pin in cases:
        tm: dict = {}
        load_and_check(spool, sample.deliver, readers=L.Readers(spool), pin_memory=pin, timings=tm,
                       alloc=lambda n: torch.empty(n, dtype=torch.uint8))  # fmt: skip
        got[name] = tm["bytes_copied"]
    assert got["slot"] == got["file"] == 0
    assert 0 < got["slot_p"] <= got["file_p"] + A.SLOT_HEADER  # the slot's header is padded to a page


def test_close_sends_the_received_of_slots_dropped_before_it(tmp_path, spool):
    """A loop that breaks out and drops its sample: close() drains the release and sends the
    RECEIVED (the last yielded sample is not acked, as for files: it comes back)."""
    arena = SFX.make_arena(spool)
    ds = [_slot_sample(spool, arena, i).deliver for i in range(2)]
    sc = FakeSidecar(tmp_path, ds, end=False)
    try:
        with _stream(sc, spool, workers=0) as s:
            for x in s:
                if x is not None:
                    break
            del x
        time.sleep(0.3)
    finally:
        sc.stop()
    first = ds[0].notice.key
    assert ("Received", first) in _said(sc) and ("Ack", first) not in _said(sc)
    assert s.slots_held == 0


def test_close_copies_out_the_last_sample_a_loop_still_holds_and_sends_its_received(tmp_path, spool):
    """``for x in stream`` ends with x still viewing the last slot: close() gives x private copies
    in place (its values unchanged), so the slot's RECEIVED goes and the sidecar can reuse it."""
    arena = SFX.make_arena(spool)
    ds = [_slot_sample(spool, arena, i).deliver for i in range(2)]
    sc = FakeSidecar(tmp_path, ds, end=False)
    try:
        with _stream(sc, spool) as s:
            got = 0
            for x in s:
                if x is not None:
                    got += 1
                    before = x.hidden_states.clone()
                    if got == 2:
                        break
            slot = next(d.notice.slot for d in ds if d.notice.key == x.key)
            data = slice(slot.offset + A.SLOT_HEADER, slot.end)
            saved = bytes(arena.map[data])
            arena.map[data] = bytes(len(saved))  # through another mapping of the same arena ...
            assert not x.hidden_states.any()  # ... x sees it: a view of the slot
            arena.map[data] = saved
            assert torch.equal(x.hidden_states, before) and s.slots_held >= 1
        time.sleep(0.3)
        arena.map[data] = bytes(len(saved))  # the slot reused by another sample, say
    finally:
        sc.stop()
    assert ("Received", x.key) in _said(sc)
    assert torch.equal(x.hidden_states, before)  # its own copy now
    assert s.slots_held == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host: see docs/benchmarks.md)")
def test_on_cuda_a_slot_goes_to_the_device_from_a_pinned_copy_and_is_released(tmp_path):
    """With ``device="cuda"`` the stream copies the slot into a pinned buffer (its copy-on-write
    mapping of the arena is never page-locked: that would make every page its own), yields the
    hidden states on the device equal to the slot's, and the slot's RECEIVED goes at once (no
    view of it is kept)."""
    with SFX.shm_spool() as spool:
        _slot_to_device(tmp_path, spool)


def _slot_to_device(tmp_path, spool):
    arena = SFX.make_arena(spool)
    w = _slot_sample(spool, arena, 0)
    sc = FakeSidecar(tmp_path, [w.deliver], end=False)
    try:
        with _stream(sc, spool, device="cuda") as s:
            x = next(v for v in s if v is not None)
            assert x.hidden_states.is_cuda
            assert torch.equal(x.hidden_states.cpu(), SFX.read_slot_tensors(spool, w.deliver.notice.slot)[SF.HIDDEN_STATES_KEY])
            assert s.stats["bytes_copied"] >= x.hidden_states.numel() * x.hidden_states.element_size()  # copied out
            assert s._readers.get("arena").maps()._arena.reads.holds() == 0  # noqa: SLF001  # let go at once
            _until(lambda: ("Received", x.key) in _said(sc), iter(s))
    finally:
        sc.stop()


def test_a_cuda_stream_never_page_locks_the_arena(tmp_path, spool, monkeypatch):
    """The arena's start-up stall on the H200 (docs/benchmarks.md) was the trainer page-locking
    the whole arena for CUDA at its first slot (cudaHostRegister of 8 GiB, about a second with the
    GIL held). Trainers map the arena copy-on-write now and copy a CUDA-bound slot into a pinned
    buffer, so nothing registers the arena at all: not when the stream connects, not after."""
    SFX.make_arena(spool)
    calls: list = []

    class Cudart:  # torch.cuda.cudart() on a CUDA build: records any registration
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802, ANN001, ANN201
            calls.append(size)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    sc = FakeSidecar(tmp_path, [], end=False)
    try:
        with _stream(sc, spool, device="cuda") as s:
            s._connect()  # noqa: SLF001 - what the first iteration does
            t0 = time.monotonic()
            while not any(isinstance(m, P.Hello) for m in list(sc.got)) and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            assert any(isinstance(m, P.Hello) for m in list(sc.got))
        assert calls == []
        assert not hasattr(s._readers.get("arena").maps(), "register_cuda")  # noqa: SLF001
    finally:
        sc.stop()
