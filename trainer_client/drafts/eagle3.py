"""Eagle-3 (speculators' ``Eagle3DraftModel``): one llama decoder layer on three aux layers,
trained with test-time training (TTT) steps; vLLM serves it as ``method: eagle3``.

Input: the aux states concatenated in ascending layer order, shifted as speculators does (the
draft at position t sees aux[t] and token t+1 and predicts the verifier at t+1). Targets: the
frozen verifier's softmax(lm_head(norm(layer N))) over the draft vocabulary; the loss a KL
divergence masked by the loss mask, summed over the TTT steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer_client.drafts.base import (
    Draft,
    Features,
    MissingLayersError,
    check_layers,
    features,
    load_draft_weights,
    loss_tokens,
    pack,
    swap_aux,
)
from trainer_client.drafts.options import AttentionOptions, option
from trainer_client.stream import Sample

__all__ = ["Eagle3", "Features", "MissingLayersError", "build_draft", "eagle3_layers", "features", "load_weights",
           "loss_tokens", "pack", "swap_aux"]  # fmt: skip


def eagle3_layers(sample: Sample, aux_layer_ids: list[int] | None = None, num_hidden_layers: int | None = None) -> list[int]:
    """The aux layer ids to train from (ascending), or a clear error naming what is missing:
    layer N and exactly three layers below it."""
    return check_layers("Eagle-3", sample, aux_layer_ids, num_hidden_layers, count=3)


def layer_config(verifier_dir: str):  # noqa: ANN201
    """The draft layer's config, built from the verifier's (speculators' own helper)."""
    from speculators.train.cli import create_transformer_layer_config

    return create_transformer_layer_config(
        verifier_dir, num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=4096, full_attention_indices=[0]
    )


def freeze_verifier_parts(model, train_lm_head: bool = False):  # noqa: ANN001, ANN201
    model = model.float()
    if train_lm_head:
        model.lm_head.weight.requires_grad_(True)
    for name in ("embed_tokens", "verifier_lm_head", "verifier_norm"):
        for p in getattr(model, name).parameters():
            p.requires_grad_(False)
    return model


def build_draft(
    verifier_dir: str,
    aux_layer_ids: list[int],
    *,
    draft_vocab_size: int,
    t2d: torch.Tensor | None,
    d2t: torch.Tensor | None,
    ttt_steps: int = 3,
    seed: int = 0,
    train_lm_head: bool = False,
    attn_impl: str = "sdpa",
):
    """A fresh draft: one llama decoder layer, verifier embeddings / norm / lm_head rows frozen.

    sdpa attention by default because flex attention has no backward on CPU; the first
    argument of ``from_training_args`` is the *draft layer's* config, built from the
    verifier's. Built on the CPU in float32 (the master weights); the trainer moves it.
    """
    from speculators.models.eagle3 import Eagle3DraftModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Eagle3DraftModel.from_training_args(
            layer_config(verifier_dir),
            t2d=t2d,
            d2t=d2t,
            verifier_name_or_path=verifier_dir,
            target_layer_ids=list(aux_layer_ids),
            draft_vocab_size=draft_vocab_size,
            norm_before_residual=True,
            ttt_steps=ttt_steps,
            draft_attn_impl=attn_impl,
        )
    return freeze_verifier_parts(model, train_lm_head)


def load_weights(model, ckpt: Path) -> None:  # noqa: ANN001
    """Trained weights from a checkpoint (``step-N/``) into a freshly built draft."""
    load_draft_weights("eagle3", model, Path(ckpt) / "draft")


@dataclass(frozen=True)
class Eagle3Options(AttentionOptions):
    ttt_steps: int = option(3, min=1, help="test-time-training steps (draft tokens unrolled)")
    ttt_step_loss_decay: float = option(1.0, help="loss weight of each TTT step relative to the one before")
    train_lm_head: bool = option(False, help="train the draft's lm_head (frozen by default, as speculators)")


class Eagle3(Draft):
    label = "Eagle-3"
    name = "eagle3"
    method = "eagle3"
    speculators_type = "eagle3"
    aux_count = 3
    Options = Eagle3Options

    @classmethod
    def holds(cls, config: dict) -> bool:
        # older Eagle-3 checkpoints name only their architecture (the registry asks this last)
        return super().holds(config) or "eagle3" in json.dumps(config.get("architectures", "")).lower()

    def positions(self) -> int:
        return int(self.opts.ttt_steps)

    def build(self, aux_layer_ids, *, draft_vocab_size, t2d, d2t, seed=0):  # noqa: ANN001, ANN201
        from speculators.losses import resolve_loss_config

        self.loss_config = resolve_loss_config("kl_div", "eager")
        return build_draft(self.cfg.verifier, aux_layer_ids, draft_vocab_size=draft_vocab_size, t2d=t2d, d2t=d2t,
                           ttt_steps=self.opts.ttt_steps, seed=seed, train_lm_head=self.opts.train_lm_head,
                           attn_impl=self.opts.draft_attn_impl)  # fmt: skip

    def forward(self, model, batch):  # noqa: ANN001, ANN201
        k = self.positions()
        _, loss, m = model(**batch, ttt_steps=k, ttt_step_loss_decay=self.opts.ttt_step_loss_decay,
                           loss_config=self.loss_config)  # fmt: skip
        return loss, [m[f"full_acc_{i}_sum"] for i in range(k)], [m[f"full_acc_{i}_total"] for i in range(k)]
