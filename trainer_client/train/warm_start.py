"""A run that starts from a draft already trained (``--init-draft DIR``): the draft serving live
traffic, which the loop keeps training on what that traffic asks.

What a fresh run would decide, the draft decides: its aux layers (the verifier layers it reads),
its draft vocabulary size and maps (``t2d``/``d2t``, saved in its weights), so the new
checkpoints load into the serving engine in place of it (``hsstream/weight_swap.py`` loads
weights into the draft that was started: same shapes, same maps). Its weights are loaded into
the freshly built draft before the first step; the optimizer starts fresh (a speculators-format
dir holds no optimizer state). A run dir that holds a checkpoint resumes from that instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


class InitDraftError(ValueError):
    pass


@dataclass(frozen=True)
class InitDraft:
    path: Path
    aux_layer_ids: list[int] | None
    draft_vocab_size: int | None
    t2d: torch.Tensor | None
    d2t: torch.Tensor | None
    speculators_type: str | None


def read_init_draft(path: str | Path, verifier_vocab_size: int) -> InitDraft:
    """The settings a warm start takes from a speculators-format draft dir."""
    d = Path(path)
    if (d / "final" / "config.json").is_file():  # a run dir: its final draft
        d = d / "final"
    cfg_file = d / "config.json"
    if not cfg_file.is_file() or not (d / "model.safetensors").is_file():
        raise InitDraftError(f"--init-draft {path}: not a draft directory (config.json and model.safetensors)")
    c = json.loads(cfg_file.read_text())
    ids = c.get("eagle_aux_hidden_state_layer_ids") or c.get("target_layer_ids")
    if ids is None:
        ids = ((c.get("speculators_config") or {}).get("verifier") or {}).get("layer_ids")
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        t2d = fh.get_tensor("t2d") if "t2d" in names else None
        d2t = fh.get_tensor("d2t") if "d2t" in names else None
    size = c.get("draft_vocab_size")
    if size is not None and int(size) < verifier_vocab_size and (t2d is None or d2t is None):
        raise InitDraftError(f"--init-draft {path}: a draft vocabulary of {size} tokens, but no t2d/d2t maps in its weights")
    return InitDraft(d.resolve(), [int(x) for x in ids] if ids else None, int(size) if size else None, t2d, d2t,
                     c.get("speculators_model_type"))  # fmt: skip
