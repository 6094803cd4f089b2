"""P-EAGLE (speculators' ``PEagleDraftModel``): Eagle-3's architecture drafting ``num_depths``
tokens in one forward, the positions past the first carrying a mask token and a learned
``mask_hidden`` instead of a token and the verifier's states; trained with COD sampling
(speculators' ``generate_cod_sample_indices``). vLLM 0.32 and 0.33 serve it as ``method: eagle3``
with ``parallel_drafting`` (their speculators loader maps ``peagle`` there and the mask token to
its ``pard_token``), the CPU build of 0.32 too. vLLM 0.34 serves it no more: its speculators
loader raises "P-EAGLE (parallel drafting EAGLE-3) is not supported" and its speculative config
takes ``parallel_drafting`` only for dflash and dspark (``method: eagle3`` would load the
checkpoint through the same loader). :func:`vllm_refusal` asks the installed vLLM's loader, so
``hsstream eval``, the launcher and the trainer's serve line refuse it there, saying what to do.

Glue only: the layers are Eagle-3's (three aux layers below N, ascending, plus N), the batch is
shifted as for Eagle-3 (speculators applies ``shift_batch`` to both), the mask token is
resolved as for DFlash (``trainer_client/drafts/dflash.py``: given, the tokenizer's, a spare
embedding row, else an error naming the draft), attention ``sdpa`` or ``eager`` (flex attention
has no backward on CPU). The verifier's embeddings stay frozen here, as for Eagle-3 (speculators'
P-EAGLE default trains them); the checkpoint carries them either way, so vLLM serves what was
trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from trainer_client.drafts.base import Draft, DraftConfigError
from trainer_client.drafts.dflash import check_mask_embedding, mask_token
from trainer_client.drafts.eagle3 import freeze_verifier_parts, layer_config
from trainer_client.drafts.options import ATTN_IMPLS, ParallelOptions, option

#: vLLM's speculators loader module, which reads a draft checkpoint's config when vLLM loads it
ALGOS = "vllm.transformers_utils.configs.speculators.algos"


def vllm_refusal(algos: ModuleType | None = None, version: str | None = None) -> str | None:
    """Why the installed vLLM (or the loader module ``algos`` of another, ``bench/
    vllm_conformance.py``) would refuse a P-EAGLE checkpoint, or None: it serves it, or there is
    no vLLM here to ask. Its own loader is asked with a P-EAGLE config (a feature check)."""
    if algos is None:
        try:
            import importlib

            import vllm

            algos = importlib.import_module(ALGOS)
        except ImportError:
            return None
        version = version or str(vllm.__version__)
    fn = getattr(algos, "SUPPORTED_SPECULATORS_TYPES", {}).get("peagle")
    try:
        if fn is None:
            raise ValueError("its speculators loader knows no 'peagle' checkpoint")
        fn({"mask_token_id": 0, "draft_vocab_size": 8}, {"model_type": "llama"})
    except (ValueError, KeyError) as e:
        return (f"vLLM {version} does not serve P-EAGLE drafts (it says: {e}). Serve this checkpoint with vLLM "
                f"0.32 or 0.33 (--speculative-config '{{\"method\": \"eagle3\", \"parallel_drafting\": true, ...}}'), "
                f"or train a parallel draft this vLLM serves: --draft dflash (--draft dspark on a GPU)")  # fmt: skip
    return None


@dataclass(frozen=True)
class PEagleOptions(ParallelOptions):
    num_depths: int = option(4, min=1, help="tokens drafted in parallel a step", why="it drafts at least one token")
    train_lm_head: bool = option(False, help="train the draft's lm_head (frozen by default, as speculators)")


class PEagle(Draft):
    label = "P-EAGLE"
    name = "peagle"
    method = "eagle3"
    speculators_type = "peagle"
    aux_count = 3
    needs_mask_token = True
    shifted = True
    Options = PEagleOptions

    def __init__(self, cfg, vcfg) -> None:  # noqa: ANN001
        super().__init__(cfg, vcfg)
        if self.opts.draft_attn_impl not in ATTN_IMPLS:
            raise DraftConfigError(f"P-EAGLE: draft_attn_impl {self.opts.draft_attn_impl!r}: use one of {ATTN_IMPLS}")
        self.mask_token_id = mask_token(self.label, cfg.verifier, self.vocab_size, self.opts.mask_token_id)

    def positions(self) -> int:
        return int(self.opts.num_depths)

    def build(self, aux_layer_ids, *, draft_vocab_size, t2d, d2t, seed=0):  # noqa: ANN001, ANN201
        from speculators.losses import resolve_loss_config
        from speculators.models.peagle import PEagleDraftModel

        cfg, o = self.cfg, self.opts
        self.loss_config = resolve_loss_config("kl_div", "eager")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = PEagleDraftModel.from_training_args(
                layer_config(cfg.verifier), t2d=t2d, d2t=d2t, verifier_name_or_path=cfg.verifier,
                target_layer_ids=list(aux_layer_ids), draft_vocab_size=draft_vocab_size, norm_before_residual=True,
                mask_token_id=self.mask_token_id, num_depths=self.positions(), draft_attn_impl=o.draft_attn_impl,
            )  # fmt: skip
        model = freeze_verifier_parts(model, o.train_lm_head)
        check_mask_embedding(self.label, model, self.mask_token_id)
        return model

    def forward(self, model, batch):  # noqa: ANN001, ANN201
        k = self.positions()
        _, loss, m = model(**batch, loss_config=self.loss_config, num_depths=k, max_anchors=int(self.opts.max_anchors))
        return loss, [m[f"position_{i}_acc_sum"] for i in range(k)], [m[f"position_{i}_acc_total"] for i in range(k)]

    @classmethod
    def refusal(cls, *, here: bool) -> str | None:
        return vllm_refusal()  # whichever host: the installed vLLM's loader refuses the checkpoint

    @classmethod
    def serve_config(cls, draft_dir: str | Path, num_speculative_tokens: int, *, here: bool = True) -> dict:
        return {**super().serve_config(draft_dir, num_speculative_tokens, here=here), "parallel_drafting": True}
