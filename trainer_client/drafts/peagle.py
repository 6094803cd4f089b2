"""P-EAGLE (speculators' ``PEagleDraftModel``): Eagle-3's architecture drafting ``num_depths``
tokens in one forward, the positions past the first carrying a mask token and a learned
``mask_hidden`` instead of a token and the verifier's states; trained with COD sampling
(speculators' ``generate_cod_sample_indices``). vLLM 0.32 serves it as ``method: eagle3`` with
``parallel_drafting`` (its speculators loader maps ``peagle`` there and the mask token to its
``pard_token``); its CPU build (Model Runner V1) too.

Glue only: the layers are Eagle-3's (three aux layers below N, ascending, plus N), the batch is
shifted as for Eagle-3 (speculators applies ``shift_batch`` to both), the mask token is
resolved as for DFlash (``trainer_client/drafts/dflash.py``: given, the tokenizer's, a spare
embedding row, else an error naming the draft), attention ``sdpa`` or ``eager`` (flex attention
has no backward on CPU). The verifier's embeddings stay frozen here, as for Eagle-3 (speculators'
P-EAGLE default trains them); the checkpoint carries them either way, so vLLM serves what was
trained.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer_client.drafts.base import Draft, DraftConfigError
from trainer_client.drafts.dflash import ATTN_IMPLS, check_mask_embedding, mask_token
from trainer_client.drafts.eagle3 import freeze_verifier_parts, layer_config


class PEagle(Draft):
    label = "P-EAGLE"
    name = "peagle"
    method = "eagle3"
    speculators_type = "peagle"
    aux_count = 3
    needs_mask_token = True
    shifted = True

    def __init__(self, cfg, vcfg) -> None:  # noqa: ANN001
        super().__init__(cfg, vcfg)
        if int(cfg.num_depths) < 1:
            raise DraftConfigError(f"P-EAGLE: num_depths {cfg.num_depths}: it drafts at least one token")
        if cfg.draft_attn_impl not in ATTN_IMPLS:
            raise DraftConfigError(f"P-EAGLE: draft_attn_impl {cfg.draft_attn_impl!r}: use one of {ATTN_IMPLS}")
        self.mask_token_id = mask_token(self.label, cfg.verifier, self.vocab_size, cfg.mask_token_id)

    def positions(self) -> int:
        return int(self.cfg.num_depths)

    def build(self, aux_layer_ids, *, draft_vocab_size, t2d, d2t, seed=0):  # noqa: ANN001, ANN201
        from speculators.losses import resolve_loss_config
        from speculators.models.peagle import PEagleDraftModel

        cfg = self.cfg
        self.loss_config = resolve_loss_config("kl_div", "eager")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = PEagleDraftModel.from_training_args(
                layer_config(cfg.verifier), t2d=t2d, d2t=d2t, verifier_name_or_path=cfg.verifier,
                target_layer_ids=list(aux_layer_ids), draft_vocab_size=draft_vocab_size, norm_before_residual=True,
                mask_token_id=self.mask_token_id, num_depths=self.positions(), draft_attn_impl=cfg.draft_attn_impl,
            )  # fmt: skip
        model = freeze_verifier_parts(model, cfg.train_lm_head)
        check_mask_embedding(self.label, model, self.mask_token_id)
        return model

    def forward(self, model, batch):  # noqa: ANN001, ANN201
        k = self.positions()
        _, loss, m = model(**batch, loss_config=self.loss_config, num_depths=k, max_anchors=int(self.cfg.max_anchors))
        return loss, [m[f"position_{i}_acc_sum"] for i in range(k)], [m[f"position_{i}_acc_total"] for i in range(k)]

    def speculative_config(self, draft_dir: str | Path) -> dict:
        return {"method": "eagle3", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": self.positions(),
                "parallel_drafting": True}  # fmt: skip
