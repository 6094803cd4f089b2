"""The arena layout on the connector's side, without vLLM or a sidecar: the gatherer copies a
request's rows straight into its slot (one copy), the writer fills in token ids and the header
last and says so in a notice naming the slot; nothing outside the slot is ever touched, a slot
too small or of another arena gets an error notice and no write; the bytes equal the file
layout's; the byte counters show the files layout copying more. (Through the sidecar: the
lead's integration tests.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from connector import protocol as P
from connector.cache_layout import gather_rows, gather_rows_into
from connector.contract import arena as A
from connector.contract import messages as M
from connector.layers import storage_permutation
from connector.scheduler_side import SchedulerSide
from connector.spool_writer import ShapeInfo, SpoolWriter
from connector.step_metadata import PendingSave
from connector.worker_side import HiddenStateGatherer
from tests.support import sample_files as SFX
from trainer_client.sample_checks import load_and_check
from connector import layouts as L

BS, H = 4, 8
LAYERS = [5, 2, 10]
PATTERN = 0xA5


@pytest.fixture
def spool(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    return d


def _cache(layout: str, num_blocks: int = 16, k: int = 3, h: int = H):
    """The cache as vLLM hands it: token-major ("old"), its layer-major view of the same memory
    ("new"), or memory that is itself layer-major ("layer-major")."""
    g = torch.Generator().manual_seed(0)
    if layout == "layer-major":
        return torch.randn((num_blocks, k, BS, h), generator=g).to(torch.bfloat16)
    phys = torch.randn((num_blocks, BS, k, h), generator=g).to(torch.bfloat16)
    return phys if layout == "old" else phys.permute(0, 2, 1, 3)


def _writer(spool, dtype="bfloat16", h=H):
    w = SpoolWriter(spool, None, ShapeInfo(LAYERS, 12, h, dtype, "tiny"), num_threads=1)
    sent: list[M.Notice] = []
    w._publish = sent.append  # type: ignore[method-assign]
    return w, sent


def _tag(slot, index=9):
    return P.RequestTag(key=P.SampleKey(job="jobA", index=index), attempt=1, slot=slot).model_dump(mode="json")


@pytest.mark.parametrize("layout", ["old", "new", "layer-major"])
@pytest.mark.parametrize("perm", [None, "perm"])
def test_gather_into_is_the_gather_with_one_copy(layout, perm):
    from connector.cache_layout import token_major_view

    view = token_major_view(_cache(layout), BS, 3)
    p = torch.tensor(storage_permutation(LAYERS)) if perm else None
    blocks = torch.tensor([7, 2, 11])
    out = torch.empty((11, 3, H), dtype=torch.bfloat16)  # 11 tokens: the last block partly used
    copied = gather_rows_into(view, blocks, 11, out, p)
    assert torch.equal(out, gather_rows(view, blocks, 11, p))
    assert copied == out.numel() * 2  # exactly the rows, once


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_slot_holds_the_file_layouts_tensors_and_nothing_outside_it_changes(spool, dtype):
    arena = SFX.make_arena(spool, 64 * A.PAGE, fill=PATTERN)
    kv = _cache("new")
    perm = storage_permutation(LAYERS)
    n, blocks = 11, [3, 0, 9]
    w, sent = _writer(spool, dtype)
    g = HiddenStateGatherer(kv, BS, 3, perm, w)
    length = SFX.slot_bytes(n, 3, H, dtype) + A.PAGE  # room to spare: the rest stays as it was
    slot = SFX.slot_for(arena, 8 * A.PAGE, length, generation=3)
    ids = list(range(100, 100 + n))
    g.submit(PendingSave("r", "hs-r.safetensors", ids, blocks, _tag(slot)))
    g.submit(PendingSave("f", "hs-f.safetensors", ids, blocks, _tag(None)))  # the same request as a file
    assert w.flush(10)
    w.close()
    ok = {x.request_id: x for x in sent}
    assert ok["r"].status == M.NoticeStatus.ok and ok["r"].file is None and ok["r"].slot == slot
    assert ok["f"].file == "hs-f.safetensors" and ok["f"].slot is None
    whole = bytes(arena.map)
    assert whole[A.PAGE : slot.offset] == bytes([PATTERN]) * (slot.offset - A.PAGE)  # before the slot
    assert whole[slot.end :] == bytes([PATTERN]) * (arena.size - slot.end)  # after it
    used = A.written_size(whole[slot.offset : slot.offset + A.SLOT_HEADER], slot.length)
    assert whole[slot.offset + used : slot.end] == bytes([PATTERN]) * (slot.end - slot.offset - used)
    in_slot = SFX.read_slot_tensors(spool, slot)
    in_file = load_file(str(spool / "hs-f.safetensors"))
    assert set(in_slot) == set(in_file)
    for k in in_file:
        assert torch.equal(in_slot[k].view(torch.uint8), in_file[k].view(torch.uint8)), k
    d = M.Deliver(notice=ok["r"], expected_token_ids=ids)
    s = load_and_check(spool, d, readers=L.Readers(spool))  # the trainer's reader takes it as it is
    assert torch.equal(s.token_ids, torch.tensor(ids))
    assert ok["r"].checksum == ok["f"].checksum  # the same bytes covered


def test_a_slot_too_small_or_of_another_arena_gets_an_error_notice_and_no_write(spool):
    arena = SFX.make_arena(spool, 64 * A.PAGE, fill=PATTERN)
    w, sent = _writer(spool)
    g = HiddenStateGatherer(_cache("old"), BS, 3, None, w)
    small = SFX.slot_for(arena, 4 * A.PAGE, A.PAGE)  # one page: not even the header and the data
    other = A.Slot(arena="0" * 32, offset=4 * A.PAGE, length=8 * A.PAGE, generation=1)
    past = SFX.slot_for(arena, 63 * A.PAGE, 8 * A.PAGE)
    before = bytes(arena.map)  # the slots assigned: their claims written
    for rid, slot in (("small", small), ("other", other), ("past", past)):
        g.submit(PendingSave(rid, f"hs-{rid}.safetensors", list(range(11)), [0, 1, 2], _tag(slot)))
    assert w.flush(10)
    w.close()
    why = {x.request_id: x.reason for x in sent if x.status == M.NoticeStatus.error}
    assert "too small" in why["small"] and "arena changed" in why["other"] and "past" in why["past"]
    assert all(x.slot is not None for x in sent)  # the error notices name the slot too
    assert bytes(arena.map) == before  # not one byte written
    assert sorted(p.name for p in spool.iterdir()) == [A.ARENA_NAME]
    assert g.poll({"small", "other", "past"}) == {"small", "other", "past"}  # their blocks are freed


def test_the_writer_never_writes_past_its_slot_even_when_asked_by_the_writer_itself(spool):
    """The check in the writer (not only the gatherer's): a job reaching it with a slot that
    cannot hold it becomes an error notice."""
    arena = SFX.make_arena(spool, 64 * A.PAGE, fill=PATTERN)
    slot = SFX.slot_for(arena, 4 * A.PAGE, A.PAGE)
    with pytest.raises(RuntimeError, match="does not fit its slot"):
        SFX.write_sample(spool, tokens=11, layer_ids=LAYERS, hidden=H, slot=slot)
    whole = bytes(arena.map)
    assert whole[slot.offset : slot.offset + 8] == bytes(8)  # zeroed, the header never came
    claim = slot.offset + A.CLAIM_AT
    assert whole[claim : claim + A.CLAIM_LEN] == A.claim_bytes(slot.generation)  # still its claim
    rest = whole[A.PAGE : slot.offset] + whole[claim + A.CLAIM_LEN :]
    assert rest == bytes([PATTERN]) * len(rest)  # nothing else written


def test_a_replaced_arena_is_mapped_again(spool):
    first = SFX.make_arena(spool, 64 * A.PAGE)
    w, sent = _writer(spool)
    g = HiddenStateGatherer(_cache("old"), BS, 3, None, w)
    length = SFX.slot_bytes(5, 3, H)
    g.submit(PendingSave("a", "hs-a.safetensors", list(range(5)), [0, 1], _tag(SFX.slot_for(first, A.PAGE, length))))
    second = SFX.make_arena(spool, 64 * A.PAGE)  # the sidecar made a new one
    g.submit(PendingSave("b", "hs-b.safetensors", list(range(5)), [0, 1], _tag(SFX.slot_for(second, A.PAGE, length))))
    g.submit(PendingSave("c", "hs-c.safetensors", list(range(5)), [0, 1], _tag(SFX.slot_for(first, A.PAGE, length))))
    assert w.flush(10)
    w.close()
    st = {x.request_id: x for x in sent}
    assert st["a"].status == st["b"].status == M.NoticeStatus.ok
    assert st["c"].status == M.NoticeStatus.error and "arena changed" in st["c"].reason


def test_the_files_layout_copies_more_than_the_arena(spool):
    """Both gather once; the file is then written whole, the slot gets only its token ids and its
    header (a page: more than a file's header, so a sample of a few kB would not show it)."""
    h = 256
    arena = SFX.make_arena(spool, 64 * A.PAGE)
    n, blocks = 30, [3, 0, 9, 12, 5, 1, 7, 8]
    perm = storage_permutation(LAYERS)
    copied = {}
    for name, slot in (("files", None), ("arena", SFX.slot_for(arena, A.PAGE, SFX.slot_bytes(n, 3, h)))):
        w, sent = _writer(spool, h=h)
        g = HiddenStateGatherer(_cache("new", h=h), BS, 3, perm, w)
        g.submit(PendingSave(name, f"hs-{name}.safetensors", list(range(n)), blocks, _tag(slot)))
        assert w.flush(10)
        w.close()
        assert sent[0].status == M.NoticeStatus.ok
        copied[name] = w.stats["bytes_copied"]
    rows = n * 3 * h * 2
    file_size = (spool / "hs-files.safetensors").stat().st_size
    assert copied["files"] == rows + file_size  # gathered, then written into the file
    assert copied["arena"] == rows + 8 * n + A.SLOT_HEADER  # gathered into the slot; ids and header
    assert copied["files"] > copied["arena"]


def test_the_scheduler_names_the_slot_and_no_path():
    arena_id = "ab" * 16
    slot = A.Slot(arena=arena_id, offset=A.PAGE, length=2 * A.PAGE, generation=4)
    tag = P.RequestTag(key=P.SampleKey(job="jobA", index=1), attempt=0, slot=slot)
    req = type("R", (), {"request_id": "cmpl-1", "kv_transfer_params": P.kv_params_for(tag), "prompt_token_ids": [1, 2],
                         "all_token_ids": [1, 2], "num_computed_tokens": 2})()  # fmt: skip
    side = SchedulerSide("/dev/shm/nowhere")
    ok, params = side.request_finished(req, [0])
    assert ok is True and params == {M.KV_PARAMS_SLOT_KEY: slot.model_dump(mode="json")}
    (p,) = side.take_pending()
    assert p.request_tag() == tag and side.take_new_locks() == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host: see docs/benchmarks.md)")
def test_on_cuda_the_rows_go_straight_into_the_registered_slot():
    with SFX.shm_spool() as spool:
        _rows_into_the_registered_slot(spool)


def _rows_into_the_registered_slot(spool):
    arena = SFX.make_arena(spool, 64 * A.PAGE, fill=PATTERN)
    kv = _cache("new").cuda()
    w, sent = _writer(spool)
    g = HiddenStateGatherer(kv, BS, 3, None, w)
    n, blocks = 11, [3, 0, 9]
    slot = SFX.slot_for(arena, 8 * A.PAGE, SFX.slot_bytes(n, 3, H))
    g.step_starts()
    g.submit(PendingSave("r", "hs-r.safetensors", list(range(n)), blocks, _tag(slot)))
    g.submit(PendingSave("f", "hs-f.safetensors", list(range(n)), blocks, _tag(None)))
    assert w.flush(10)
    torch.cuda.synchronize()
    w.close()
    m = w.layouts.get("arena")._arena  # the arena's writer half (connector/layouts/arena.py) maps it
    assert m is not None and m.cuda_registered
    assert [x.status for x in sent] == [M.NoticeStatus.ok] * 2
    in_slot = SFX.read_slot_tensors(spool, slot)
    in_file = load_file(str(spool / "hs-f.safetensors"))
    assert torch.equal(in_slot[P.HIDDEN_STATES_KEY], in_file[P.HIDDEN_STATES_KEY])
    assert bytes(arena.map)[slot.end :] == bytes([PATTERN]) * (arena.size - slot.end)
