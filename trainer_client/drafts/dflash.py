"""DFlash (speculators' ``DFlashDraftModel``): a block draft that predicts ``block_size - 1``
tokens in one forward from an anchor token and mask tokens, attending to the verifier's aux
states through a projection (``fc``); vLLM 0.32 serves it as ``method: dflash``, its CPU build
too (non-causal CPU attention, C++ fallbacks for the DFlash input kernels).

What is ours here is only glue:

* Layers. DFlash reads any number of aux layers (default Eagle-3's 2, N//2, N-3, so the same
  stream trains either) plus layer N for its targets. The ids are the stream's (layer id ``i``
  = the residual entering layer ``i`` = HF ``hidden_states[i]``) and go into the checkpoint as
  speculators' ``aux_hidden_state_layer_ids`` unchanged: vLLM's speculators loader
  (``vllm/transformers_utils/configs/speculators/algos.py``, ``update_dflash``) keeps them as
  ``eagle_aux_hidden_state_layer_ids`` (what the verifier captures) and writes
  ``dflash_config.target_layer_ids = [i - 1 ...]`` (z-lab's DFlash counts a layer's output,
  ``hidden_states[i + 1]``, as layer ``i``), which its runner turns back with ``+ 1``.
  :func:`vllm_target_layer_ids` is that mapping, checked by the tests against vLLM's loader.
* Batches are not shifted (speculators feeds DFlash no ``shift_batch``): position t carries
  token t and the aux states of t; anchors are sampled among loss-carrying positions.
* Mask token: ``TrainConfig.mask_token_id``, else the verifier tokenizer's mask token, else a
  spare embedding row (an id past the tokenizer's last, when the embedding has one); with
  none of these the run stops naming the draft and ``--mask-token-id`` (:func:`mask_token`).
* Attention: ``sdpa`` or ``eager`` (speculators' default flex attention has no backward on
  CPU); every draft layer full attention (vLLM serves no mixed sliding/full DFlash draft).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trainer_client.drafts.base import Draft, DraftConfigError
from trainer_client.drafts.options import ATTN_IMPLS, ParallelOptions, option

log = logging.getLogger("hsstream.train")

__all__ = ["ATTN_IMPLS", "DFlash", "DFlashOptions", "check_mask_embedding", "finish_block_draft", "mask_token",
           "vllm_target_layer_ids"]  # fmt: skip


def vllm_target_layer_ids(aux_layer_ids: list[int]) -> list[int]:
    """Our (speculators') aux layer ids → vLLM's ``dflash_config.target_layer_ids``."""
    return [i - 1 for i in aux_layer_ids]


def mask_token(draft: str, verifier: str, vocab_size: int, given: int | None) -> int:
    """The mask token a parallel draft puts at the positions it drafts (see the module docstring)."""
    if given is not None:
        if not 0 <= int(given) < vocab_size:
            raise DraftConfigError(f"{draft}: --mask-token-id {given} is outside the verifier's vocabulary (0..{vocab_size - 1})")
        return int(given)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(verifier)
    except (OSError, ValueError) as e:
        raise DraftConfigError(f"{draft} needs a mask token and the verifier's tokenizer cannot be read ({e}): "
                               f"pass --mask-token-id") from e  # fmt: skip
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    if len(tok) < vocab_size:
        log.warning("%s: the verifier's tokenizer has no mask token; using the spare embedding row %d "
                    "(no token of the tokenizer has it)", draft, len(tok))  # fmt: skip
        return len(tok)
    raise DraftConfigError(
        f"{draft} needs a mask token (mask_token_id: the id its parallel positions carry), and the verifier has "
        f"none: its tokenizer declares no mask token and all {vocab_size} embedding rows are tokens. Pass "
        f"--mask-token-id ID (mask_token_id: in the config file), e.g. a special token the data never holds"
    )


def check_mask_embedding(draft: str, model, mask_token_id: int) -> None:  # noqa: ANN001
    """A mask token whose embedding row is zero (a padding row: ``nn.Embedding(padding_idx=...)``
    leaves it zero and training never moves it) makes every drafted position's query zero after
    the norm: the draft cannot attend to anything and learns only the unigram. Refused."""
    row = model.embed_tokens.weight[int(mask_token_id)]
    if not bool(row.detach().abs().sum() > 0):
        raise DraftConfigError(
            f"{draft}: mask token {mask_token_id}'s embedding row in the verifier is all zeros (a padding token?): "
            f"the drafted positions would carry no signal; pass another --mask-token-id (a token with a trained or "
            f"initialised embedding that the data never holds)"
        )



def finish_block_draft(label: str, model, mask_token_id: int, frozen) -> object:  # noqa: ANN001
    """A built or loaded block draft (DFlash, DSpark) made ready to train: float32 master
    weights, its mask token's embedding checked, and the parts that are the verifier's own
    (a full-vocabulary lm_head, ``frozen``) without gradients."""
    model = model.float()
    check_mask_embedding(label, model, mask_token_id)
    if not getattr(model, "use_draft_vocab", True):  # full vocabulary: lm_head is the verifier's, never saved
        model.lm_head.weight.requires_grad_(False)
    for name in frozen:
        for p in getattr(model, name).parameters():
            p.requires_grad_(False)
    return model

@dataclass(frozen=True)
class DFlashOptions(ParallelOptions):
    block_size: int = option(4, min=2, help="tokens per block: the anchor and block_size - 1 drafted a step",
                             why="a block is the anchor and at least one token")  # fmt: skip
    num_draft_layers: int = option(1, min=1, flags=("--num-layers",), keys=("num_layers",), help="draft decoder layers")


class DFlash(Draft):
    label = "DFlash"
    name = "dflash"
    method = "dflash"
    speculators_type = "dflash"
    aux_count = None  # any number (at least one)
    needs_mask_token = True
    shifted = False
    bucket_rows = False  # its blocks are drawn over the whole row: padding would move them
    Options = DFlashOptions

    def __init__(self, cfg, vcfg) -> None:  # noqa: ANN001
        super().__init__(cfg, vcfg)
        if self.opts.draft_attn_impl not in ATTN_IMPLS:
            raise DraftConfigError(f"{self.label}: draft_attn_impl {self.opts.draft_attn_impl!r}: use one of {ATTN_IMPLS}")
        # resolved now, when the trainer is made: a run without one stops before anything is submitted
        self.mask_token_id = mask_token(self.label, cfg.verifier, self.vocab_size, self.opts.mask_token_id)

    def positions(self) -> int:
        return int(self.opts.block_size) - 1

    @classmethod
    def checkpoint_positions(cls, config: dict) -> int:
        return int(config.get("block_size", 8)) - (0 if config.get("sample_from_anchor") else 1)

    def build(self, aux_layer_ids, *, draft_vocab_size, t2d, d2t, seed=0):  # noqa: ANN001, ANN201
        from speculators.losses import resolve_loss_config
        from speculators.models.dflash import DFlashDraftModel
        from speculators.train.cli import create_transformer_layer_config

        cfg, o = self.cfg, self.opts
        n = int(o.num_draft_layers)
        layer_cfg = create_transformer_layer_config(cfg.verifier, num_layers=n, draft_arch="qwen3", hidden_act=None,
                                                    sliding_window=4096, full_attention_indices=list(range(n)))  # fmt: skip
        self.loss_config = resolve_loss_config("kl_div", "eager")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = DFlashDraftModel.from_training_args(
                layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=cfg.verifier, target_layer_ids=list(aux_layer_ids),
                draft_vocab_size=draft_vocab_size, block_size=int(o.block_size), mask_token_id=self.mask_token_id,
                draft_attn_impl=o.draft_attn_impl,
            )  # fmt: skip
        return finish_block_draft(self.label, model, self.mask_token_id, self.frozen)

    def forward(self, model, batch):  # noqa: ANN001, ANN201
        _, loss, m = model(**batch, loss_config=self.loss_config, max_anchors=int(self.opts.max_anchors),
                           per_position_loss_weight="fixed-exp-decay")  # fmt: skip
        k = self.positions()
        return loss, [m[f"position_{i}_acc_sum"] for i in range(1, k + 1)], \
            [m[f"position_{i}_acc_total"] for i in range(1, k + 1)]
