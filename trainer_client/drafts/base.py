"""What every draft plug-in implements, and the sample → tensor helpers they share.

The generic trainer (``trainer_client/train/``) knows no algorithm: it asks a :class:`Draft`
which verifier layers it reads, checks each sample against them, has it pack batches, build
(or load) the model, compute loss and per-position metrics, and say how vLLM serves the
checkpoint. The helpers here are kept free of speculators and of the model, so that the checks
(does the stream carry what this draft needs?) run, and fail clearly, before anything heavy is
loaded.

Layer ids are the stream's: layer id ``i`` is the residual stream entering decoder layer ``i``
(HF ``hidden_states[i]``), ``N`` (the number of layers) the last layer's output before the final
norm. That is also what vLLM's ``eagle_aux_hidden_state_layer_ids`` and speculators'
``aux_hidden_state_layer_ids`` / ``eagle_aux_hidden_state_layer_ids`` mean.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from trainer_client.drafts.options import DraftConfigError, DraftOptions
from trainer_client.stream import Sample

log = logging.getLogger("hsstream.train")
__all__ = ["DraftConfigError", "DraftOptions", "Draft", "MissingLayersError", "NotServable"]


class MissingLayersError(ValueError):
    """The stream does not carry what a draft is trained from (layers, hidden size, tensors)."""


class NotServable(ValueError):
    """vLLM would not serve this draft's checkpoints (the message says which vLLM and what instead)."""


def layer_hint(n: int, aux: list[int] | None = None) -> str:
    ids = [*(aux if aux is not None else [2, n // 2, n - 3]), n]
    return f"start the stack with layer ids {sorted(set(ids))} (HSSTREAM_LAYER_IDS)"


_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def check_layers(draft: str, sample: Sample, aux_layer_ids: list[int] | None, num_hidden_layers: int | None,
                 *, count: int | None = 3) -> list[int]:  # fmt: skip
    """The aux layer ids to train from (ascending), or a clear error naming the draft and what it lacks.

    Every draft here needs layer N (the verifier's last layer, pre-norm: the targets come from
    it) and ``count`` layers below N (None: any number, at least one). vLLM hands the aux states
    to the draft in ascending layer order whatever order its config lists them in, so training
    concatenates them in ascending order too.
    """
    n = sample.num_hidden_layers
    if num_hidden_layers is not None and n != num_hidden_layers:
        raise MissingLayersError(
            f"{draft}: sample {sample.key} comes from a verifier with {n} layers, but the verifier checkpoint given "
            f"to the trainer has {num_hidden_layers}: the stream and --model must be the same model"
        )
    have = list(sample.layer_ids)
    hint = layer_hint(n)
    many = _WORDS.get(count, str(count))
    if n not in have:
        raise MissingLayersError(
            f"{draft}: the stream carries layers {have} but not layer N={n} (the verifier's last layer, pre-norm), "
            f"from which the {draft} targets are computed; {hint}"
        )
    below = sorted(lid for lid in have if lid != n)
    if aux_layer_ids is not None:
        want = sorted(aux_layer_ids)
        missing = [lid for lid in want if lid not in below]
        if missing:
            raise MissingLayersError(
                f"{draft}: the stream carries layers {have} but not aux layer(s) {missing} of the requested {want}; "
                f"either request aux layers among {below} or {hint}"
            )
        if count is not None and len(want) != count:
            raise MissingLayersError(f"{draft} takes exactly {many} aux layers, {len(want)} requested: {want}")
        return want
    if (count is not None and len(below) != count) or not below:
        raise MissingLayersError(
            f"{draft} needs exactly {many} aux layers below N={n}; the stream carries {below or 'none'} "
            f"(pass the {many} to use, or {hint})"
        )
    return below


def check_sample(draft: str, sample: Sample, hidden_size: int) -> None:
    """The tensors every draft reads: token ids, [T, L, H] hidden states of the verifier's width."""
    hs = getattr(sample, "hidden_states", None)
    ids = getattr(sample, "token_ids", None)
    if hs is None or ids is None or hs.dim() != 3:
        raise MissingLayersError(f"{draft}: sample {sample.key} lacks token ids or [tokens, layers, hidden] states")
    ids_l = list(sample.layer_ids)
    if len(ids_l) != hs.shape[1] or len(set(ids_l)) != len(ids_l):
        raise MissingLayersError(
            f"{draft}: sample {sample.key} names layers {ids_l} for {hs.shape[1]} hidden-state slices: each slice "
            f"needs its own distinct layer id, in the order of the slices (the stream's layer_ids)"
        )
    if hs.shape[-1] != hidden_size:
        raise MissingLayersError(f"{draft}: sample {sample.key} has hidden size {hs.shape[-1]}, the verifier {hidden_size}")


@dataclass
class Features:
    """One sample's training tensors, un-shifted (float32 on CPU, the file's dtype on a GPU)."""

    key: str
    input_ids: torch.Tensor  # [T] long
    aux: torch.Tensor  # [T, A*H], ascending layer order
    last: torch.Tensor  # [T, H] (layer N)
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


def loss_tokens_unshifted(sample: Sample) -> int:
    t = int(sample.token_ids.shape[0])
    if t < 2:
        return 0
    return int(sample.loss_mask.sum()) if sample.loss_mask is not None else t


def swap_aux(f: Features, donor: Features) -> Features:
    """Negative control: ``f``'s tokens and targets with another sample's aux states.

    If the draft still did as well with these, it would not be using the hidden states.
    Both are cut to the shorter length.
    """
    t = min(f.num_tokens, donor.num_tokens)
    return Features(f.key, f.input_ids[:t], donor.aux[:t], f.last[:t], f.loss_mask[:t])


def pack(items: list[Features]) -> dict[str, torch.Tensor]:
    """Several samples in one row, shifted as speculators' ``shift_batch`` does (Eagle-3, P-EAGLE).

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
    return _row(ids, aux, last, mask, doc, pos)


def pack_unshifted(items: list[Features]) -> dict[str, torch.Tensor]:
    """Several samples in one row as they are (DFlash: speculators feeds it no ``shift_batch``):
    position t carries token t, the aux states of position t and the verifier's layer N at t;
    positions restart at 0 for each sample."""
    ids, aux, last, mask, doc, pos = [], [], [], [], [], []
    for d, f in enumerate(items):
        t = f.num_tokens
        if t < 2:
            continue
        ids.append(f.input_ids)
        aux.append(f.aux)
        last.append(f.last)
        mask.append(f.loss_mask)
        doc.append(torch.full((t,), d, dtype=torch.long, device=f.input_ids.device))
        pos.append(torch.arange(0, t, dtype=torch.long, device=f.input_ids.device))
    return _row(ids, aux, last, mask, doc, pos)


#: The shortest row :func:`pad_to_bucket` makes: rows of 128 tokens and less are one shape.
BUCKET_LEAST = 128


def bucket_length(n: int, least: int = BUCKET_LEAST) -> int:
    """The row length ``n`` tokens are padded to on CUDA: the next power of two (``least`` at least)."""
    return max(least, 1 << max(0, n - 1).bit_length())


def pad_to_bucket(row: dict[str, torch.Tensor], least: int = BUCKET_LEAST) -> dict[str, torch.Tensor]:
    """``row`` (one packed row, ``[1, n, ...]`` each) padded to :func:`bucket_length` tokens, as
    speculators' own collate pads every batch to its ``total_seq_len``: document id -1, loss mask,
    ids, positions and hidden states 0, so the padding attends to nothing and counts for nothing.

    Why: on CUDA speculators compiles each draft's forward (``torch.compile``), which sees a new
    shape as a new graph; rows of every length recompiled until dynamo's limit of 8 and then ran
    uncompiled (an H100 run trained 1.3 samples/s, its first 30 steps taking 73 s). Powers of two
    from 128 to 4,096 are six shapes. On CPU nothing is compiled and rows are left as they are."""
    n = row["input_ids"].shape[1]
    size = bucket_length(n, least)
    if size == n:
        return row
    out = {}
    for name, t in row.items():
        fill = -1 if name == "document_ids" else 0
        out[name] = torch.cat([t, t.new_full((t.shape[0], size - n, *t.shape[2:]), fill)], dim=1)
    return out


def _row(ids, aux, last, mask, doc, pos) -> dict[str, torch.Tensor]:  # noqa: ANN001
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


def load_draft_weights(draft: str, model: torch.nn.Module, draft_dir: str | Path) -> None:
    """``model.safetensors`` of ``draft_dir`` into ``model``; what the model leaves out of its
    checkpoints (the verifier's parts, the vocabulary maps) may be missing, nothing else."""
    from safetensors.torch import load_file

    sd = load_file(str(Path(draft_dir) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()) | {
        "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t"}  # fmt: skip
    bad = [k for k in missing if k not in allowed]
    if bad or unexpected:
        raise RuntimeError(f"{draft}: {draft_dir} does not match the draft: missing {bad}, unexpected {unexpected}")


class Draft:
    """One draft algorithm, as the generic trainer uses it. Subclasses set the class attributes
    and implement :meth:`build` and :meth:`forward`; the rest has defaults most drafts keep.

    A draft owns its settings (``Options``: the flags and config keys ``hsstream train`` takes
    for it) and how vLLM serves its checkpoints (:meth:`serve_config`, :meth:`refusal`), which
    ``hsstream eval``, the launcher and the trainer's printed serve line all ask.

    An instance belongs to one run: it is made from the run's ``TrainConfig`` (``cfg``) and the
    verifier's ``text_config`` (``vcfg``), and may keep what :meth:`build` resolved (a mask
    token, a loss config).
    """

    #: its settings (trainer_client/drafts/options.py), parsed from ``cfg.draft_options`` into ``self.opts``
    Options: ClassVar[type[DraftOptions]] = DraftOptions

    name: ClassVar[str]
    #: how messages name it
    label: ClassVar[str]
    #: vLLM's ``--speculative-config`` ``method`` that serves this draft's checkpoints
    method: ClassVar[str]
    #: the speculators ``speculators_model_type`` its checkpoints carry
    speculators_type: ClassVar[str]
    #: None: any number of aux layers (at least one); else exactly this many
    aux_count: ClassVar[int | None] = 3
    #: whether it needs a mask token (parallel drafting)
    needs_mask_token: ClassVar[bool] = False
    #: the verifier's frozen parts the draft holds (never trained; checked by the GPU smoke test)
    frozen: ClassVar[tuple[str, ...]] = ("embed_tokens", "verifier_lm_head", "verifier_norm")

    def __init__(self, cfg: Any, vcfg: dict) -> None:
        self.cfg = cfg
        self.vcfg = vcfg
        given = dict(getattr(cfg, "draft_options", None) or {})
        self.opts: Any = self.Options.parse(given, self.label)
        others = sorted(set(given) - {o.name for o in self.Options.specs()})
        if others:
            log.warning("%s takes no %s (another draft's setting): ignored", self.label, ", ".join(others))
        self.num_hidden_layers = int(vcfg["num_hidden_layers"])
        self.hidden_size = int(vcfg["hidden_size"])
        self.vocab_size = int(vcfg["vocab_size"])
        self.mask_token_id: int | None = None

    # -- what it reads from the stream ---------------------------------------------------------
    def default_layers(self) -> list[int]:
        n = self.num_hidden_layers
        return [2, n // 2, n - 3]

    def layers(self, requested: list[int] | None) -> list[int]:
        """The aux layers of a fresh run: ``requested`` (validated) or the draft's default."""
        n = self.num_hidden_layers
        ids = sorted(requested) if requested else self.default_layers()
        if not ids or not all(0 <= i < n for i in ids) or len(set(ids)) != len(ids):
            raise MissingLayersError(f"{self.label} takes distinct aux layers below N={n}, got {ids}")
        if self.aux_count is not None and len(ids) != self.aux_count:
            many = _WORDS.get(self.aux_count, str(self.aux_count))
            raise MissingLayersError(f"{self.label} takes {many} aux layers below N={n}, got {ids}")
        return ids

    def check(self, sample: Sample, aux_layer_ids: list[int]) -> None:
        check_sample(self.label, sample, self.hidden_size)
        check_layers(self.label, sample, aux_layer_ids, self.num_hidden_layers, count=self.aux_count)

    # -- batches ----------------------------------------------------------------------------------
    shifted: ClassVar[bool] = True

    def features(self, sample: Sample, aux_layer_ids: list[int], *, dtype: torch.dtype | None = torch.float32,
                 to: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Features:  # fmt: skip
        return features(sample, aux_layer_ids, dtype=dtype, to=to)

    def pack(self, items: list[Features]) -> dict[str, torch.Tensor]:
        return pack(items) if self.shifted else pack_unshifted(items)

    #: On CUDA, rows padded to a few lengths (:func:`pad_to_bucket`) so speculators' compiled
    #: forward is not recompiled per length. Only where padding leaves the loss and the counts
    #: as they are (Eagle-3, P-EAGLE: tests/unit/trainer_client/test_bucket_rows.py); DFlash and
    #: DSpark draw their blocks over the whole row, so padding would change what they train on.
    bucket_rows: ClassVar[bool] = True

    def device_row(self, row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``row`` as a step on a CUDA device takes it (:attr:`bucket_rows`)."""
        return pad_to_bucket(row) if self.bucket_rows else row

    def loss_tokens(self, sample: Sample) -> int:
        return loss_tokens(sample) if self.shifted else loss_tokens_unshifted(sample)

    # -- the model --------------------------------------------------------------------------------
    def positions(self) -> int:
        """How many draft positions the per-position metrics (``top1_i``) and vLLM's
        ``num_speculative_tokens`` count."""
        raise NotImplementedError

    def build(self, aux_layer_ids: list[int], *, draft_vocab_size: int, t2d: torch.Tensor | None,
              d2t: torch.Tensor | None, seed: int = 0) -> torch.nn.Module:  # fmt: skip
        """A fresh draft on the CPU in float32, the verifier's parts frozen."""
        raise NotImplementedError

    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list, list]:
        """(loss, correct per position, counted per position): tensors on the device."""
        raise NotImplementedError

    def load_weights(self, model: torch.nn.Module, draft_dir: Path) -> None:
        """Trained weights from a saved ``draft/`` into a freshly built draft (verifier parts stay)."""
        load_draft_weights(self.label, model, draft_dir)

    # -- serving ----------------------------------------------------------------------------------
    @classmethod
    def holds(cls, config: dict) -> bool:
        """Whether a checkpoint's ``config.json`` is one of this draft's."""
        return config.get("speculators_model_type") == cls.speculators_type

    @classmethod
    def checkpoint_positions(cls, config: dict) -> int:
        """The draft tokens a step a checkpoint of this draft is served with (its config's
        ``speculators_config.proposal_methods[0].speculative_tokens``, which speculators writes)."""
        props = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        return int(props[0].get("speculative_tokens") or 3)

    @classmethod
    def refusal(cls, *, here: bool) -> str | None:
        """Why vLLM would not serve this draft's checkpoints, or None. ``here``: also what only
        this host's vLLM build lacks (``hsstream eval`` and the launcher serve here; the trainer's
        serve line may be run on another host). Decided by asking the installed vLLM (a feature
        check), never by its version string."""
        return None

    @classmethod
    def serve_config(cls, draft_dir: str | Path, num_speculative_tokens: int, *, here: bool = True) -> dict:
        """What ``vllm serve --speculative-config`` takes for a checkpoint of this draft in
        ``draft_dir``; :class:`NotServable` where vLLM would refuse it (:meth:`refusal`)."""
        why = cls.refusal(here=here)
        if why is not None:
            raise NotServable(why)
        return {"method": cls.method, "model": str(Path(draft_dir).resolve()),
                "num_speculative_tokens": int(num_speculative_tokens)}  # fmt: skip

    @classmethod
    def serve_checkpoint(cls, draft_dir: str | Path, num_speculative_tokens: int | None = None) -> dict:
        """:meth:`serve_config` for a saved checkpoint, its draft tokens a step from its config
        unless given (``hsstream eval``, ``hsstream vllm``: they serve here)."""
        n = num_speculative_tokens
        if n is None:
            n = cls.checkpoint_positions(json.loads((Path(draft_dir) / "config.json").read_text()))
        return cls.serve_config(draft_dir, n, here=True)

    def speculative_config(self, draft_dir: str | Path) -> dict:
        """The trainer's serve line for this run's checkpoint (wherever it is served: ``here`` False)."""
        return self.serve_config(draft_dir, self.positions(), here=False)

    def describe(self) -> dict:
        """What this run's draft is, for ``run.json`` and the checkpoint state."""
        return {"draft": self.name, "method": self.method, "positions": self.positions(),
                "mask_token_id": self.mask_token_id, "options": self.opts.as_dict()}  # fmt: skip
