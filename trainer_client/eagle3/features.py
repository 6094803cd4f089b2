"""From streamed samples to the tensors speculators' Eagle-3 forward expects.

Kept free of speculators and of the model so that the checks (does the stream carry what
Eagle-3 needs?) run, and fail clearly, before anything heavy is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer_client.stream import Sample


class MissingLayersError(ValueError):
    """The stream does not carry the layers an Eagle-3 draft is trained from."""


def eagle3_layers(sample: Sample, aux_layer_ids: list[int] | None = None, num_hidden_layers: int | None = None) -> list[int]:
    """The aux layer ids to train from (ascending), or a clear error naming what is missing.

    Eagle-3 needs layer N (the verifier's last layer, pre-norm: the targets come from it)
    and three layers below N (the draft's input). vLLM hands the aux states to the draft in
    ascending layer order whatever order its config lists them in, so training concatenates
    them in ascending order too.
    """
    n = sample.num_hidden_layers
    if num_hidden_layers is not None and n != num_hidden_layers:
        raise MissingLayersError(
            f"sample {sample.key} comes from a verifier with {n} layers, but the verifier checkpoint given to the "
            f"trainer has {num_hidden_layers}: the stream and --model must be the same model"
        )
    have = list(sample.layer_ids)
    hint = f"start the stack with layer ids [2, {n // 2}, {n - 3}, {n}] (HSSTREAM_LAYER_IDS)"
    if n not in have:
        raise MissingLayersError(
            f"the stream carries layers {have} but not layer N={n} (the verifier's last layer, pre-norm), from which "
            f"the Eagle-3 targets are computed; {hint}"
        )
    below = sorted(lid for lid in have if lid != n)
    if aux_layer_ids is not None:
        want = sorted(aux_layer_ids)
        missing = [lid for lid in want if lid not in below]
        if missing:
            raise MissingLayersError(
                f"the stream carries layers {have} but not aux layer(s) {missing} of the requested {want}; "
                f"either request aux layers among {below} or {hint}"
            )
        if len(want) != 3:
            raise MissingLayersError(f"Eagle-3 takes exactly three aux layers, {len(want)} requested: {want}")
        return want
    if len(below) != 3:
        raise MissingLayersError(
            f"Eagle-3 needs exactly three aux layers below N={n}; the stream carries {below or 'none'} "
            f"(pass the three to use, or {hint})"
        )
    return below


@dataclass
class Features:
    """One sample's training tensors, un-shifted (float32 on CPU, the file's dtype on a GPU)."""

    key: str
    input_ids: torch.Tensor  # [T] long
    aux: torch.Tensor  # [T, 3H] float32, ascending layer order
    last: torch.Tensor  # [T, H] float32 (layer N)
    loss_mask: torch.Tensor  # [T] bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def features(sample: Sample, aux_layer_ids: list[int], *, dtype: torch.dtype | None = torch.float32,
             to: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Features:  # fmt: skip
    """``dtype`` None keeps the file's (bf16 on a GPU, where autocast computes in it anyway);
    ``to``: copies each of the sample's tensors to the device first (the trainer's host→device
    copy), so the layer selection and the packing run there, not on the host."""
    hs, ids = sample.hidden_states, sample.token_ids
    t = hs.shape[0]
    mask = sample.loss_mask if sample.loss_mask is not None else torch.ones(t, dtype=torch.bool)
    if to is not None:
        hs, ids, mask = to(hs), to(ids), to(mask)
    idx = [sample.layer_ids.index(lid) for lid in aux_layer_ids]
    aux = hs[:, idx].reshape(t, -1)
    last = hs[:, sample.layer_ids.index(sample.num_hidden_layers)]
    if dtype is not None:
        aux, last = aux.to(dtype), last.to(dtype)
    return Features(str(sample.key), ids.long(), aux, last, mask.bool())


def loss_tokens(sample: Sample) -> int:
    """Loss-carrying positions of a sample once shifted (``pack`` drops position 0)."""
    t = int(sample.token_ids.shape[0])
    if t < 2:
        return 0
    return int(sample.loss_mask[1:].sum()) if sample.loss_mask is not None else t - 1


def swap_aux(f: Features, donor: Features) -> Features:
    """Negative control: ``f``'s tokens and targets with another sample's aux states.

    If the draft still did as well with these, it would not be using the hidden states.
    Both are cut to the shorter length.
    """
    t = min(f.num_tokens, donor.num_tokens)
    return Features(f.key, f.input_ids[:t], donor.aux[:t], f.last[:t], f.loss_mask[:t])


def pack(items: list[Features]) -> dict[str, torch.Tensor]:
    """Several samples in one row, shifted as speculators' ``shift_batch`` does.

    The draft at position t sees aux[t] and token t+1 and predicts the verifier's
    distribution at t+1; document ids keep attention inside each sample, positions restart
    at 1 for each.
    """
    ids, aux, last, mask, doc, pos = [], [], [], [], [], []
    for d, f in enumerate(items):
        t = f.num_tokens
        if t < 2:
            continue
        ids.append(f.input_ids[1:])
        aux.append(f.aux[:-1])
        last.append(f.last[1:])
        mask.append(f.loss_mask[1:])
        doc.append(torch.full((t - 1,), d, dtype=torch.long, device=f.input_ids.device))
        pos.append(torch.arange(1, t, dtype=torch.long, device=f.input_ids.device))
    if not ids:
        raise ValueError("no sample with at least two tokens to pack")
    return {
        "input_ids": torch.cat(ids)[None],
        "hidden_states": torch.cat(aux)[None],
        "verifier_last_hidden_states": torch.cat(last)[None],
        "loss_mask": torch.cat(mask)[None],
        "document_ids": torch.cat(doc)[None],
        "position_ids": torch.cat(pos)[None],
    }
