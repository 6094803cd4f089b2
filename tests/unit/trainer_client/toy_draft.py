"""A toy draft plug-in that exists only in the tests (``test_draft_plugin.py`` registers it):
one linear layer from the aux states to the verifier's last layer. What a new draft writes:
its options, its model, its loss and how vLLM serves its checkpoints; nothing else in the
product changes to add it but one registry line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainer_client.drafts.base import Draft
from trainer_client.drafts.options import DraftOptions, option

TOY_TYPE = "toy"


@dataclass(frozen=True)
class ToyOptions(DraftOptions):
    toy_width: int = option(2, min=1, help="a test draft's width (tests only)", keys=("toy_size",))


class ToyModel(torch.nn.Module):
    def __init__(self, aux: int, hidden: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.proj = torch.nn.Linear(aux, hidden)

    def save_pretrained(self, path: str | Path) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(p / "model.safetensors"))
        (p / "config.json").write_text(json.dumps({"speculators_model_type": TOY_TYPE, "toy_width": self.width,
                                                   "speculators_config": {"proposal_methods": [{"speculative_tokens": 1}]}}))


class Toy(Draft):
    label = "Toy"
    name = "toy"
    method = "toy"
    speculators_type = TOY_TYPE
    aux_count = 3
    Options = ToyOptions

    def positions(self) -> int:
        return 1

    def build(self, aux_layer_ids, *, draft_vocab_size, t2d, d2t, seed=0):  # noqa: ANN001, ANN201
        torch.manual_seed(seed)
        return ToyModel(len(aux_layer_ids) * self.hidden_size, self.hidden_size, self.opts.toy_width)

    def forward(self, model, batch):  # noqa: ANN001, ANN201
        pred = model.proj(batch["hidden_states"])
        err = (pred - batch["verifier_last_hidden_states"]).pow(2).mean(-1)
        mask = batch["loss_mask"].float()
        loss = (err * mask).sum() / mask.sum().clamp(min=1)
        return loss, [torch.zeros(())], [mask.sum()]

    @classmethod
    def serve_config(cls, draft_dir, num_speculative_tokens, *, here=True):  # noqa: ANN001, ANN206
        width = json.loads((Path(draft_dir) / "config.json").read_text())["toy_width"]
        return {**super().serve_config(draft_dir, num_speculative_tokens, here=here), "toy_width": width}
