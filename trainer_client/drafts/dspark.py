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
* Serving here: :meth:`DSpark.refusal` refuses, before any engine starts, where the installed
  vLLM would pick its V1 runner (it has one, and cannot run V2 here: the CPU build), naming
  the GPU it needs. vLLM 0.34 has no V1 runner: there vLLM's own start-up decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer_client.drafts.dflash import DFlash, DFlashOptions, finish_block_draft
from trainer_client.drafts.options import option

#: How the V1 model runner of vLLM ≤ 0.33 refuses a dspark draft (``VllmConfig``, vllm/config/vllm.py)
V1_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


def vllm_target_layer_ids(aux_layer_ids: list[int]) -> list[int]:
    """Our (speculators') aux layer ids → vLLM's DSpark ``target_layer_ids``."""
    return [i - 1 for i in aux_layer_ids]


def v2_runner_available() -> bool:
    """Whether this vLLM build can run its V2 model runner: a CUDA-like platform with Triton
    (vLLM's own test in ``VllmConfig.use_v2_model_runner``; the CPU build of 0.32 has neither)."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    return bool(current_platform.is_cuda_alike() and HAS_TRITON)


def vllm_refusal() -> str | None:
    """Why the installed vLLM cannot serve a DSpark draft on this host, or None (it can, or
    there is no vLLM to ask, or it has no V1 runner to fall back to and decides at start-up)."""
    try:
        import vllm
        from vllm.config import VllmConfig
    except ImportError:
        return None
    if not hasattr(VllmConfig, "_get_v1_model_runner_unsupported_features") or v2_runner_available():
        return None
    return (f"a dspark draft needs a GPU: vLLM {vllm.__version__} serves dspark only with its V2 model runner (a CUDA "
            f"GPU and Triton); this vLLM (its CPU build) would run the V1 runner, which refuses it: \"{V1_REFUSAL}\". "
            f"Serve it on a GPU host (--speculative-config '{{\"method\": \"dspark\", ...}}')")  # fmt: skip


@dataclass(frozen=True)
class DSparkOptions(DFlashOptions):
    block_size: int = option(4, min=2, help="tokens per block, each drafted a step (the anchor's slot too)",
                             why="a block is the anchor and at least one token")  # fmt: skip
    markov_rank: int = option(256, min=1, help="rank of the Markov logit-bias head",
                              why="vLLM's DSpark always has the Markov head, its rank must be at least 1 "
                                  "(0 would be DFlash: --draft dflash)")  # fmt: skip
    confidence_head_alpha: float = option(1.0, min=0.0, help="weight of the confidence head's loss",
                                          why="a loss weight must be >= 0")  # fmt: skip


class DSpark(DFlash):
    label = "DSpark"
    name = "dspark"
    method = "dspark"
    speculators_type = "dspark"
    aux_count = None  # any number (at least one), as DFlash
    needs_mask_token = True
    shifted = False
    Options = DSparkOptions

    def positions(self) -> int:
        return int(self.opts.block_size)  # sample_from_anchor: the anchor's slot drafts too

    @classmethod
    def refusal(cls, *, here: bool) -> str | None:
        return vllm_refusal() if here else None  # the trainer's line is for a GPU host

    def build(self, aux_layer_ids, *, draft_vocab_size, t2d, d2t, seed=0):  # noqa: ANN001, ANN201
        from speculators.losses import resolve_loss_config
        from speculators.models.dspark import DSparkDraftModel
        from speculators.train.cli import create_transformer_layer_config

        cfg, o = self.cfg, self.opts
        n = int(o.num_draft_layers)
        layer_cfg = create_transformer_layer_config(cfg.verifier, num_layers=n, draft_arch="qwen3", hidden_act=None,
                                                    sliding_window=4096, full_attention_indices=list(range(n)))  # fmt: skip
        self.loss_config = resolve_loss_config("kl_div", "eager")
        self.tv_loss_fn = resolve_loss_config("tv", "eager")["tv"][0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = DSparkDraftModel.from_training_args(
                layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=cfg.verifier, target_layer_ids=list(aux_layer_ids),
                draft_vocab_size=draft_vocab_size, block_size=int(o.block_size), mask_token_id=self.mask_token_id,
                draft_attn_impl=o.draft_attn_impl, sample_from_anchor=True, markov_rank=int(o.markov_rank),
                markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
            )  # fmt: skip
        return finish_block_draft(self.label, model, self.mask_token_id, self.frozen)

    def forward(self, model, batch):  # noqa: ANN001, ANN201
        _, loss, m = model(**batch, loss_config=self.loss_config, tv_loss_fn=self.tv_loss_fn,
                           max_anchors=int(self.opts.max_anchors), per_position_loss_weight="fixed-exp-decay",
                           confidence_head_alpha=float(self.opts.confidence_head_alpha))  # fmt: skip
        k = self.positions()
        return loss, [m[f"position_{i}_acc_sum"] for i in range(k)], [m[f"position_{i}_acc_total"] for i in range(k)]

    def describe(self) -> dict:
        return {**super().describe(), "markov_rank": int(self.opts.markov_rank),
                "confidence_head_alpha": float(self.opts.confidence_head_alpha)}  # fmt: skip
