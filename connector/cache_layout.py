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


def gather_rows_into(
    view: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor,
    perm: torch.Tensor | None = None,
) -> int:
    """Rows ``[num_tokens, K, H]`` of a request, and their layers in ``perm`` order, copied into
    ``out`` (contiguous, e.g. a view of the arena slot the sample goes to) with ONE copy; returns
    the bytes copied (what ``SpoolWriter.stats["bytes_copied"]`` counts).

    :func:`gather_rows` copies the request's whole blocks (the last one's unused rows too) and a
    second time to reorder the layers; here one ``index_select`` takes each (token, layer) row of
    ``H`` values straight from the cache's storage, seen as ``[rows, H]``, whatever the order of
    its token and layer axes (both vLLM layouts). A cache whose rows are not whole ``H``-runs of
    its storage (never seen) falls back to :func:`gather_rows` plus a copy, counted as such."""
    bs, k, h = view.shape[1], view.shape[2], view.shape[3]
    need = -(-num_tokens // bs)
    if block_ids.numel() < need:
        raise CacheLayoutError(f"request has {block_ids.numel()} blocks, {need} needed for {num_tokens} tokens")
    if tuple(out.shape) != (num_tokens, k, h) or out.dtype != view.dtype or not out.is_contiguous():
        raise CacheLayoutError(f"gather target {tuple(out.shape)} {out.dtype} is not a contiguous "
                               f"{(num_tokens, k, h)} {view.dtype}")  # fmt: skip
    s0, s1, s2, s3 = view.stride()
    if s3 != 1 or s0 % h or s1 % h or s2 % h or view.storage_offset() % h or out.device != view.device:
        rows = gather_rows(view, block_ids, num_tokens, perm)
        out.copy_(rows)
        blocks_bytes, out_bytes = need * bs * k * h * view.element_size(), out.numel() * out.element_size()
        return blocks_bytes + (out_bytes if perm is not None else 0) + out_bytes
    if num_tokens == 0:
        return 0
    dev = view.device
    t = torch.arange(num_tokens, device=dev)
    blocks = block_ids[:need].to(dev)[t // bs]
    layers = perm if perm is not None else torch.arange(k, device=dev)
    elem = (blocks * s0 + (t % bs) * s1)[:, None] + layers.to(dev)[None, :] * s2  # [T, K] element offsets
    nrows = ((view.shape[0] - 1) * s0 + (bs - 1) * s1 + (k - 1) * s2) // h + 1
    flat = view.as_strided((nrows, h), (h, 1), view.storage_offset())
    torch.index_select(flat, 0, (elem // h).reshape(-1), out=out.view(num_tokens * k, h))
    return out.numel() * out.element_size()
