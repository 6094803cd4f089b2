"""The one way tests build sample files: a spool file, its notice and the Deliver for it.

Written by the connector's own writer (``connector/spool_writer.py``), so the tensors, the
payload encoding (``connector/contract/payload.py``, FP8 included), the checksum and the bytes
and order it covers (``connector/contract/sample_file.py``) and the header's notice are the
product's, never re-coded here. A test that needs a broken file asks for one (``corrupt``,
``notice_kw``) or breaks the valid file this builds in its own way.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file

from connector.contract import arena as A
from connector.contract import messages as M, sample_file as SF
from connector.contract import payload as PL
from connector.spool_writer import ShapeInfo, SpoolWriter, WriteJob

#: What ``corrupt`` may ask for: "checksum" changes one stored bit after the checksum was taken
#: (the notice's checksum no longer matches); "nan" writes a NaN into the hidden states before
#: the writer takes its checksum (intact bytes, a non-finite value).
CORRUPTIONS = ("checksum", "nan")


class SampleFile(NamedTuple):
    path: Path  # the arena layout: the arena's file
    notice: M.Notice
    deliver: M.Deliver
    hidden_states: torch.Tensor  # as stored in the file (FP8: the quantised values)
    token_ids: torch.Tensor


def random_hidden_states(tokens: int, layers: int, hidden: int, *, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return torch.randn((tokens, layers, hidden), generator=g).to(dtype)


def write_sample(
    spool: str | Path,
    name: str = "hs-0.safetensors",
    *,
    tokens: int = 8,
    layer_ids: list[int] | None = None,
    hidden: int = 16,
    dtype: str = "bfloat16",
    hidden_states: torch.Tensor | None = None,
    token_ids: list[int] | torch.Tensor | None = None,
    seed: int = 0,
    key: M.SampleKey | None = None,
    attempt: int = 0,
    plain: bool = False,
    request_id: str | None = None,
    num_hidden_layers: int | None = None,
    model: str = "m",
    algo: str = SF.CHECKSUM_ALGO,
    corrupt: str | None = None,
    slot: A.Slot | None = None,
    **notice_kw: Any,
) -> SampleFile:
    """Write one sample file into ``spool`` as the connector does, and return it with its notice.

    ``hidden_states`` [T, K, H] is in the verifier's dtype (the writer encodes it to ``dtype``,
    e.g. ``float8_e4m3fn``); left out, random values of ``tokens`` × ``layer_ids`` × ``hidden``
    from ``seed``. ``plain``: a plain vLLM request's file (no sample key). ``notice_kw``
    overrides notice fields after the write (a bad field: the header's notice and the delivered
    one both carry it).

    ``slot``: the arena layout, the sample written into that slot of the arena in ``spool``
    (:func:`make_arena`) by the same writer; ``notice_kw`` then changes only the delivered
    notice (the slot's header keeps the writer's: e.g. another ``slot`` generation), and
    ``corrupt="checksum"`` flips a stored bit in the slot."""
    spool = Path(spool)
    layer_ids = list(layer_ids or [1, 2])
    model_dtype = dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    if token_ids is not None:
        tokens = len(token_ids)
    if hidden_states is None:
        hidden_states = random_hidden_states(tokens, len(layer_ids), hidden, seed=seed,
                                             dtype=getattr(torch, model_dtype))  # fmt: skip
    hs = hidden_states.clone()
    tokens, hidden = hs.shape[0], hs.shape[2]
    if token_ids is None:
        token_ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(seed + 1))
    ids = [int(t) for t in token_ids]
    if corrupt not in (None, *CORRUPTIONS):
        raise ValueError(f"unknown corruption {corrupt!r} (known: {', '.join(CORRUPTIONS)})")
    if corrupt == "nan":
        hs[tokens // 2, -1, hidden // 2] = float("nan")
    shape = ShapeInfo(layer_ids=layer_ids, num_hidden_layers=num_hidden_layers or max(layer_ids),
                      hidden_size=hidden, dtype=dtype, model=model)  # fmt: skip
    w = SpoolWriter(spool, None, shape, num_threads=1, checksum_algo=algo)
    sent: list[M.Notice] = []
    w._publish = sent.append  # type: ignore[method-assign]  # the notice the writer would send
    tag = None if plain else M.RequestTag(key=key or M.SampleKey(job="j", index=0), attempt=attempt, slot=slot)
    w.submit(WriteJob(request_id or name, name, tag, ids, hs))
    try:
        assert w.flush(30), "the writer did not finish"
    finally:
        w.close()
    (notice,) = sent
    if notice.status != M.NoticeStatus.ok:
        raise RuntimeError(f"the writer failed: {notice.reason}")
    notice = notice.model_copy(update={"sent_at": time.time(), **notice_kw})
    if slot is not None:
        if notice_kw:  # the header says what the delivery says, as a file's header does below
            _rewrite_slot_metadata(spool, slot, SF.header_metadata(notice))
        tensors = read_slot_tensors(spool, slot)
        if corrupt == "checksum":
            tensors[SF.HIDDEN_STATES_KEY].view(-1).view(torch.uint8)[0] ^= 1
        tensors = {k: v.clone() for k, v in tensors.items()}
        return SampleFile(spool / A.ARENA_NAME, notice, M.Deliver(notice=notice, expected_token_ids=ids),
                          tensors[SF.HIDDEN_STATES_KEY], tensors[SF.TOKEN_IDS_KEY])  # fmt: skip
    path = spool / name
    tensors = load_file(str(path))
    if corrupt == "checksum" or notice_kw:
        if corrupt == "checksum":
            tensors[SF.HIDDEN_STATES_KEY].view(-1).view(torch.uint8)[0] ^= 1
        save_file(tensors, str(path), metadata=SF.header_metadata(notice))
    return SampleFile(path, notice, M.Deliver(notice=notice, expected_token_ids=ids),
                      tensors[SF.HIDDEN_STATES_KEY], tensors[SF.TOKEN_IDS_KEY])  # fmt: skip


@contextlib.contextmanager
def shm_spool():
    """A spool directory on /dev/shm (tmpfs), removed after: where arenas live in production, and
    the only file mappings CUDA can page-lock (``cudaHostRegister`` refuses other files')."""
    d = Path(tempfile.mkdtemp(prefix="hsstream-test-arena-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def make_arena(spool: str | Path, size: int = 1 << 20, *, fill: int | None = None) -> A.Arena:
    """A new arena in ``spool`` (as the sidecar makes it); ``fill``: every byte after its first
    page set to this value, so a test can see which bytes a writer touched."""
    arena = A.Arena.create(spool, size)
    if fill is not None:
        arena.map[A.PAGE :] = bytes([fill]) * (arena.size - A.PAGE)
    return arena


def _rewrite_slot_metadata(spool: str | Path, slot: A.Slot, metadata: dict[str, str]) -> None:
    """Replace a written slot's header metadata (its tensors' table kept), padded as the writer pads it."""
    arena = A.Arena.open(spool)
    try:
        head = bytes(arena.map[slot.offset : slot.offset + A.SLOT_HEADER])
        table = json.loads(head[8:])
        table["__metadata__"] = metadata
        body = json.dumps(table, separators=(",", ":")).encode()
        room = A.SLOT_HEADER - 8
        assert len(body) <= room, "the rewritten header does not fit the slot's"
        arena.map[slot.offset + 8 : slot.offset + A.SLOT_HEADER] = body + b" " * (room - len(body))
    finally:
        arena.close()


def slot_for(arena: A.Arena, offset: int, length: int, generation: int = 1) -> A.Slot:
    """A slot of ``arena`` assigned as the sidecar assigns one (its claim written), unless it lies
    past the arena's end (then only named: the writer must refuse it)."""
    slot = A.Slot(arena=arena.id, offset=offset, length=length, generation=generation)
    if slot.end <= arena.size:
        arena.assign(slot)
    return slot


def slot_bytes(tokens: int, layers: int, hidden: int, dtype: str = "bfloat16") -> int:
    """The slot a sample of this shape needs (what the sidecar would assign)."""
    return A.slot_length(tokens * (PL.bytes_per_position(layers, hidden, dtype) + 8))


def read_slot_tensors(spool: str | Path, slot: A.Slot) -> dict[str, torch.Tensor]:
    """A written slot's tensors as views of a fresh mapping of the arena (the contract's parser)."""
    arena = A.Arena.open(spool)
    head = bytes(arena.map[slot.offset : slot.offset + A.SLOT_HEADER])
    size = A.written_size(head, slot.length)
    spans, _ = SF.parse_header(head, size, PL.safetensors_itemsizes())
    base = torch.frombuffer(arena.map, dtype=torch.uint8)[slot.offset : slot.offset + size]
    return {k: base[sp.start : sp.end].view(PL.safetensors_torch_dtype(sp.dtype)).view(sp.shape)
            for k, sp in spans.items()}  # fmt: skip
