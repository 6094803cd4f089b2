"""Reading a request's rows out of the hidden-state cache, for both vLLM cache layouts."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from connector.cache_layout import (  # noqa: E402
    CacheLayoutError,
    block_chunks,
    gather_rows,
    token_major_view,
)
from connector.layers import LayerIdError, storage_permutation, validate_layer_ids  # noqa: E402

H = 4
LAYER_CODE = 100  # values encode (block, slot, stored layer id, h); see _phys


def _phys(num_blocks: int, bs: int, stored_layers: list[int]) -> torch.Tensor:
    """Physical token-major cache [blocks, block_size, K, H] whose every element is unique.

    value = ((block * bs + slot) * LAYER_CODE + layer_id) * H + h, exact in float64.
    """
    k = len(stored_layers)
    slot = torch.arange(num_blocks * bs, dtype=torch.float64).reshape(num_blocks, bs, 1, 1)
    layer = torch.tensor(stored_layers, dtype=torch.float64).reshape(1, 1, k, 1)
    h = torch.arange(H, dtype=torch.float64).reshape(1, 1, 1, H)
    return ((slot * LAYER_CODE + layer) * H + h).contiguous()


def _as_layout(phys: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "old":  # vLLM <= 0.28: [blocks, block_size, K, H]
        return phys
    assert layout == "new"  # vLLM 0.30+: logical [blocks, K, block_size, H] over the same memory
    return phys.permute(0, 2, 1, 3)


def _expected(phys: torch.Tensor, block_ids: list[int], num_tokens: int, perm: list[int] | None) -> torch.Tensor:
    bs = phys.shape[1]
    rows = [phys[block_ids[t // bs], t % bs] for t in range(num_tokens)]
    out = torch.stack(rows)
    return out[:, perm] if perm is not None else out


def _random_blocks(rng: random.Random, num_blocks: int, need: int) -> list[int]:
    while True:
        ids = rng.sample(range(num_blocks), need)
        if need < 2 or any(b != a + 1 for a, b in zip(ids, ids[1:])):
            return ids  # not one contiguous ascending run


def _decode(rows: torch.Tensor, bs: int):
    """(global slot, layer id) of every row element at h == 0."""
    code = (rows[..., 0] / H).round().long()
    return code // LAYER_CODE, code % LAYER_CODE


@pytest.mark.parametrize("layout", ["old", "new"])
@pytest.mark.parametrize(
    ("bs", "stored", "num_tokens"),
    [
        (16, [2, 5, 10], 37),  # K != block_size, T not a multiple of block_size
        (4, [1, 2, 3, 4], 11),  # K == block_size: only the strides can tell
        (3, [0, 7, 8], 8),  # K == block_size again, odd sizes
        (8, [6], 1),  # a single token, a single layer
    ],
)
def test_gather_rows_both_layouts(layout, bs, stored, num_tokens):
    rng = random.Random(1234 + bs)
    num_blocks = 12
    phys = _phys(num_blocks, bs, stored)
    kv = _as_layout(phys, layout)
    view = token_major_view(kv, bs, len(stored))
    assert tuple(view.shape) == (num_blocks, bs, len(stored), H)
    assert view.data_ptr() == phys.data_ptr()  # a view, not a copy
    assert torch.equal(view, phys)

    need = -(-num_tokens // bs)
    blocks = _random_blocks(rng, num_blocks, need)
    rows = gather_rows(view, torch.tensor(blocks), num_tokens)
    assert tuple(rows.shape) == (num_tokens, len(stored), H)
    assert torch.equal(rows, _expected(phys, blocks, num_tokens, None))

    slots, layers = _decode(rows, bs)
    want_slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(num_tokens)])
    assert torch.equal(slots, want_slots[:, None].expand(-1, len(stored)))
    assert torch.equal(layers, torch.tensor(stored)[None, :].expand(num_tokens, -1))


@pytest.mark.parametrize("layout", ["old", "new"])
def test_extra_blocks_are_ignored(layout):
    bs, stored, n = 4, [1, 2], 6
    phys = _phys(10, bs, stored)
    view = token_major_view(_as_layout(phys, layout), bs, 2)
    blocks = [7, 2, 9, 0]  # vLLM may hand more blocks than the tokens need
    rows = gather_rows(view, torch.tensor(blocks), n)
    assert torch.equal(rows, _expected(phys, blocks, n, None))


def test_gather_rows_copies():
    phys = _phys(4, 4, [1, 2])
    view = token_major_view(phys, 4, 2)
    rows = gather_rows(view, torch.tensor([3, 1]), 5)
    before = phys.clone()
    rows.fill_(-1)
    assert torch.equal(phys, before)


def test_gather_rows_too_few_blocks():
    phys = _phys(4, 4, [1, 2])
    with pytest.raises(CacheLayoutError, match="2 blocks, 3 needed"):
        gather_rows(token_major_view(phys, 4, 2), torch.tensor([0, 1]), 9)


@pytest.mark.parametrize("layout", ["old", "new"])
@pytest.mark.parametrize("bs", [16, 3])  # 3 == K: the ambiguous case
def test_gather_rows_with_layer_permutation(layout, bs):
    user = [5, 2, 10]
    stored = sorted(user)  # vLLM stores the aux layers in ascending order
    perm = storage_permutation(user)
    assert perm == [1, 0, 2]
    phys = _phys(9, bs, stored)
    view = token_major_view(_as_layout(phys, layout), bs, len(user))
    n = 2 * bs + 1
    blocks = _random_blocks(random.Random(7), 9, 3)
    rows = gather_rows(view, torch.tensor(blocks), n, torch.tensor(perm))
    assert torch.equal(rows, _expected(phys, blocks, n, perm))
    _, layers = _decode(rows, bs)
    assert torch.equal(layers, torch.tensor(user)[None, :].expand(n, -1))  # the user's order


@pytest.mark.parametrize(
    "shape",
    [(4, 5, 3, H), (4, 3, 5, H), (4, 16, 16, H), (4, 4, 2, H), (4, 16, 3), (1, 4, 16, 3, H)],
)
def test_unknown_shapes_are_refused(shape):
    with pytest.raises(CacheLayoutError):
        token_major_view(torch.zeros(shape), 16, 3)


# --------------------------------------------------------------------------------- chunks


@pytest.mark.parametrize(
    ("num_tokens", "bs", "max_tokens"),
    [(37, 16, 32), (37, 16, 16), (37, 16, 5), (1, 16, 8192), (64, 16, 64), (100, 7, 30), (100, 7, 10**6), (5, 1, 2)],
)
def test_block_chunks_cover_each_token_once(num_tokens, bs, max_tokens):
    need = -(-num_tokens // bs)
    rng = random.Random(num_tokens * 31 + bs)
    blocks = rng.sample(range(1000), need + 2)  # two spare blocks at the end
    pieces = list(block_chunks(blocks, num_tokens, bs, max_tokens))
    bound = max(bs, (max_tokens // bs) * bs)
    covered: list[int] = []
    used: list[int] = []
    for first, chunk, ntok in pieces:
        assert first == len(covered)
        assert first % bs == 0
        assert 0 < ntok <= len(chunk) * bs <= bound
        assert ntok > (len(chunk) - 1) * bs  # no block without tokens
        assert chunk == blocks[first // bs : first // bs + len(chunk)]
        covered.extend(range(first, first + ntok))
        used.extend(chunk)
    assert covered == list(range(num_tokens))
    assert used == blocks[:need]


@pytest.mark.parametrize("layout", ["old", "new"])
def test_chunked_gather_equals_full_gather(layout):
    """The CUDA path's loop (chunk by chunk into one buffer), run on the CPU."""
    bs, stored, n = 4, [3, 1, 2], 23
    phys = _phys(16, bs, sorted(stored))
    view = token_major_view(_as_layout(phys, layout), bs, 3)
    perm = torch.tensor(storage_permutation(stored))
    blocks = _random_blocks(random.Random(3), 16, 6)
    out = torch.full((n, 3, H), -1.0, dtype=phys.dtype)
    for first, chunk, ntok in block_chunks(blocks, n, bs, 9):
        out[first : first + ntok] = gather_rows(view, torch.tensor(chunk), ntok, perm)
    assert torch.equal(out, gather_rows(view, torch.tensor(blocks), n, perm))
    assert torch.equal(out, _expected(phys, blocks, n, perm.tolist()))


def test_block_chunks_too_few_blocks_is_an_error():
    with pytest.raises((CacheLayoutError, ValueError)):
        list(block_chunks([3, 1], 40, 16, 8192))


# ----------------------------------------------------------------------------- layer ids


def test_validate_layer_ids_keeps_user_order():
    assert validate_layer_ids((36, 2, 18, 33), 36) == [36, 2, 18, 33]
    assert validate_layer_ids([0, 36], 36) == [0, 36]  # id N: the last layer's output
    assert validate_layer_ids([500]) == [500]  # no range check without the layer count


def test_validate_layer_ids_names_duplicates():
    with pytest.raises(LayerIdError) as e:
        validate_layer_ids([2, 18, 2, 33, 33, 18, 7], 36)
    msg = str(e.value)
    assert "[2, 18, 33]" in msg
    assert "duplicate" in msg


@pytest.mark.parametrize(("ids", "bad"), [([-1, 3], "[-1]"), ([3, 37], "[37]"), ([40, 2, -5], "[40, -5]")])
def test_validate_layer_ids_out_of_range(ids, bad):
    with pytest.raises(LayerIdError, match=r"outside 0\.\.36") as e:
        validate_layer_ids(ids, 36)
    assert bad in str(e.value)


@pytest.mark.parametrize("ids", [[], ()])
def test_validate_layer_ids_empty(ids):
    with pytest.raises(LayerIdError, match="no layer ids"):
        validate_layer_ids(ids, 36)


@pytest.mark.parametrize(
    "user", [[5, 2, 10], [36, 2, 18, 33], [3, 2, 1, 0], [7]],
)
def test_storage_permutation_maps_ascending_to_user_order(user):
    perm = storage_permutation(user)
    stored = sorted(user)
    got = [stored[i] for i in (perm if perm is not None else range(len(user)))]
    assert got == user


def test_storage_permutation_none_when_already_ascending():
    assert storage_permutation([2, 18, 33, 36]) is None
