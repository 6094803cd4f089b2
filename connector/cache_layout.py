"""Reading rows out of the dummy draft's hidden-state cache, whatever vLLM version made it.

vLLM up to 0.28 hands connectors the cache as ``[blocks, block_size, K, H]``; 0.30+ hands a
logical ``[blocks, K, block_size, H]`` view of the same memory. Version checks would rot, so
we detect the layout from shape and strides: the physical token axis is the one with the
larger stride (a token's K layers are stored together), which also settles K == block_size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class CacheLayoutError(RuntimeError):
    pass


def token_major_view(kv: torch.Tensor, block_size: int, num_layers: int) -> torch.Tensor:
    """A ``[blocks, block_size, K, H]`` view of the cache, without copying."""
    if kv.dim() != 4:
        raise CacheLayoutError(f"hidden-state cache has shape {tuple(kv.shape)}; expected 4 dims")
    _, a, b, _ = kv.shape
    a_is_tokens = a == block_size and b == num_layers
    b_is_tokens = b == block_size and a == num_layers
    if a_is_tokens and b_is_tokens:  # K == block_size: only the strides can tell
        a_is_tokens = kv.stride(1) >= kv.stride(2)
        b_is_tokens = not a_is_tokens
    if a_is_tokens:
        return kv
    if b_is_tokens:
        return kv.permute(0, 2, 1, 3)
    raise CacheLayoutError(
        f"hidden-state cache shape {tuple(kv.shape)} matches neither [blocks, {block_size}, {num_layers}, H] "
        f"nor [blocks, {num_layers}, {block_size}, H]"
    )


def gather_rows(
    view: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[num_tokens, K, H]`` of a request whose cache blocks are ``block_ids`` (a copy)."""
    bs = view.shape[1]
    need = -(-num_tokens // bs)
    if block_ids.numel() < need:
        raise CacheLayoutError(f"request has {block_ids.numel()} blocks, {need} needed for {num_tokens} tokens")
    rows = view.index_select(0, block_ids[:need]).reshape(need * bs, view.shape[2], view.shape[3])[:num_tokens]
    if perm is not None:
        rows = rows.index_select(1, perm)
    return rows


def block_chunks(block_ids: Sequence[int], num_tokens: int, block_size: int, max_tokens: int):
    """Split a request into (first_token, block_ids, tokens) pieces of at most ``max_tokens``.

    Bounded pieces keep the device-side scratch small on long contexts (a full-length gather
    per request can run a GPU out of memory).
    """
    per = max(1, max_tokens // block_size)
    need = -(-num_tokens // block_size)
    if len(block_ids) < need:
        raise CacheLayoutError(f"request has {len(block_ids)} blocks, {need} needed for {num_tokens} tokens")
    ids = list(block_ids[:need])
    for start in range(0, len(ids), per):
        chunk = ids[start : start + per]
        first = start * block_size
        yield first, chunk, min(num_tokens - first, len(chunk) * block_size)
