"""DSpark (speculators' ``DSparkDraftModel``): DFlash's block draft plus a low-rank Markov
logit-bias head (the token drafted at block slot k is biased by the token at slot k-1) and a
confidence head (each slot's predicted acceptance probability, trained against the draft's
analytical acceptance rate ``1 - TV``). vLLM 0.32 serves it as ``method: dspark`` on the GPU
only: its DSpark speculator lives in the V2 model runner (``vllm/v1/worker/gpu/spec_decode/
dspark/``) and the V1 runner, the only one of the CPU build, refuses it in
``VllmConfig._get_v1_model_runner_unsupported_features`` (``vllm/config/vllm.py``) with
``Model Runner V1 does not support: dspark speculative decoding``.

What is ours is the glue; the model, its loss and metrics are speculators':

* Layers, batches, mask token, attention: DFlash's (``trainer_client/drafts/dflash.py``): any
  number of aux layers below N plus N for the targets, unshifted rows, the mask token given or
  the tokenizer's or a spare embedding row, ``sdpa``/``eager`` (no flex backward on CPU).
* Anchor sampling: ``sample_from_anchor`` on (speculators' and DeepSeek's DSpark default): every
  slot of a block, the anchor's too, drafts a token, so a step drafts ``block_size`` tokens and
  the per-position metrics are ``position_0 .. position_{block_size-1}``.
* Heads: the Markov head ``vanilla`` (vLLM's ``Qwen3DSparkModel`` implements only that one; its
  ``DSparkMarkovHead`` has no gate nor recurrent state) with ``TrainConfig.markov_rank`` > 0
  (vLLM builds the head unconditionally); the confidence head on, fed the Markov embedding too,
  weighted ``TrainConfig.confidence_head_alpha`` in the loss.
* Checkpoint: speculators' ``save_pretrained``. vLLM's loader (``vllm/transformers_utils/configs/
  speculators/algos.py``, ``update_dspark``) reads ``aux_hidden_state_layer_ids`` as the layers
  the verifier captures and writes ``target_layer_ids = [i - 1 ...]`` (DSpark, like z-lab's
  DFlash, counts a layer's output as its id): :func:`vllm_target_layer_ids`, checked by the tests
  against that function. It names the architecture ``Qwen3DSparkModel`` and prefixes every weight
  but ``lm_head`` with ``model.``, which matches speculators' names (``markov_head.markov_w1``,
  ``confidence_head.proj``, the DFlash backbone's).
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer_client.drafts.base import Draft, DraftConfigError
from trainer_client.drafts.dflash import ATTN_IMPLS, finish_block_draft, mask_token


def vllm_target_layer_ids(aux_layer_ids: list[int]) -> list[int]:
    """Our (speculators') aux layer ids → vLLM's DSpark ``target_layer_ids``."""
    return [i - 1 for i in aux_layer_ids]


class DSpark(Draft):
    label = "DSpark"
    name = "dspark"
    method = "dspark"
    speculators_type = "dspark"
    aux_count = None  # any number (at least one), as DFlash
    needs_mask_token = True
    shifted = False

    def __init__(self, cfg, vcfg) -> None:  # noqa: ANN001
        super().__init__(cfg, vcfg)
        if int(cfg.block_size) < 2:
            raise DraftConfigError(f"DSpark: block_size {cfg.block_size}: a block is the anchor and at least one token")
        if cfg.draft_attn_impl not in ATTN_IMPLS:
            raise DraftConfigError(f"DSpark: draft_attn_impl {cfg.draft_attn_impl!r}: use one of {ATTN_IMPLS}")
        if int(cfg.markov_rank) < 1:
            raise DraftConfigError(f"DSpark: markov_rank {cfg.markov_rank}: vLLM's DSpark always has the Markov head, "
                                   f"its rank must be at least 1 (0 would be DFlash: --draft dflash)")  # fmt: skip
        if not float(cfg.confidence_head_alpha) >= 0:
            raise DraftConfigError(f"DSpark: confidence_head_alpha {cfg.confidence_head_alpha} must be >= 0")
        self.mask_token_id = mask_token(self.label, cfg.verifier, self.vocab_size, cfg.mask_token_id)

    def positions(self) -> int:
        return int(self.cfg.block_size)  # sample_from_anchor: the anchor's slot drafts too

    def build(self, aux_layer_ids, *, draft_vocab_size, t2d, d2t, seed=0):  # noqa: ANN001, ANN201
        from speculators.losses import resolve_loss_config
        from speculators.models.dspark import DSparkDraftModel
        from speculators.train.cli import create_transformer_layer_config

        cfg = self.cfg
        n = int(cfg.num_draft_layers)
        layer_cfg = create_transformer_layer_config(cfg.verifier, num_layers=n, draft_arch="qwen3", hidden_act=None,
                                                    sliding_window=4096, full_attention_indices=list(range(n)))  # fmt: skip
        self.loss_config = resolve_loss_config("kl_div", "eager")
        self.tv_loss_fn = resolve_loss_config("tv", "eager")["tv"][0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = DSparkDraftModel.from_training_args(
                layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=cfg.verifier, target_layer_ids=list(aux_layer_ids),
                draft_vocab_size=draft_vocab_size, block_size=int(cfg.block_size), mask_token_id=self.mask_token_id,
                draft_attn_impl=cfg.draft_attn_impl, sample_from_anchor=True, markov_rank=int(cfg.markov_rank),
                markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
            )  # fmt: skip
        return finish_block_draft(self.label, model, self.mask_token_id, self.frozen)

    def forward(self, model, batch):  # noqa: ANN001, ANN201
        _, loss, m = model(**batch, loss_config=self.loss_config, tv_loss_fn=self.tv_loss_fn,
                           max_anchors=int(self.cfg.max_anchors), per_position_loss_weight="fixed-exp-decay",
                           confidence_head_alpha=float(self.cfg.confidence_head_alpha))  # fmt: skip
        k = self.positions()
        return loss, [m[f"position_{i}_acc_sum"] for i in range(k)], [m[f"position_{i}_acc_total"] for i in range(k)]

    def speculative_config(self, draft_dir: str | Path) -> dict:
        return {"method": "dspark", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": self.positions()}

    def describe(self) -> dict:
        return {**super().describe(), "markov_rank": int(self.cfg.markov_rank),
                "confidence_head_alpha": float(self.cfg.confidence_head_alpha)}  # fmt: skip
