"""What vLLM serves a draft checkpoint directory with, here: the registry finds the draft the
directory holds (its ``config.json``), and the draft's plug-in says how vLLM serves it and
whether the installed vLLM can (``Draft.serve_checkpoint``, ``Draft.refusal``). ``hsstream
eval`` (``hsstream/evaluate.py``), the launcher's ``--speculative-config``
(``hsstream/launch.py``) and ``bench/served_acceptance/acceptance.py`` ask here; the trainer asks its draft itself
for the line it prints. Nothing here knows a draft by name.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer_client import drafts as D


class DraftError(ValueError):
    """The directory is not a draft the installed vLLM can serve (the message says why)."""


def _config(d: Path, draft: str | Path) -> dict:
    cfg = d / "config.json"
    if not cfg.is_file():
        hint = " (a run dir? its draft is in final/ or checkpoints/*/)" if (d / "final").is_dir() or (d / "checkpoints").is_dir() else ""
        raise DraftError(f"--draft {draft}: no config.json, not a speculators-format draft{hint}")
    try:
        c = json.loads(cfg.read_text())
    except ValueError as e:
        raise DraftError(f"--draft {draft}: config.json is not JSON ({e})") from e
    if not isinstance(c, dict):
        raise DraftError(f"--draft {draft}: config.json is not a JSON object")
    return c


def draft_class(draft: str | Path) -> type[D.Draft]:
    """The registered draft ``draft``'s checkpoint is one of, or :class:`DraftError`."""
    d = Path(draft)
    if not d.is_dir():
        raise DraftError(f"--draft {draft}: no such directory")
    c = _config(d, draft)
    cls = D.draft_for_checkpoint(c)
    if cls is None:
        kinds = ", ".join(D.get(n).label for n in D.names())
        raise DraftError(f"--draft {draft}: config.json is not a draft of a kind trained here ({kinds}; "
                         f"speculators_model_type {c.get('speculators_model_type')!r})")  # fmt: skip
    return cls


def check_draft_dir(draft: str | Path) -> Path:
    """``draft`` resolved, or :class:`DraftError` saying what is missing or why the installed
    vLLM would not serve it (before an engine starts)."""
    cls = draft_class(draft)
    d = Path(draft)
    if not any(d.glob("*.safetensors")) and not any(d.glob("*.bin")):
        raise DraftError(f"--draft {draft}: no weights (*.safetensors)")
    why = cls.refusal(here=True)
    if why is not None:
        raise DraftError(f"--draft {draft}: {why}")
    return d.resolve()


def speculative_config(draft: str | Path, num_speculative_tokens: int | None = None) -> dict:
    """vLLM's ``--speculative-config`` for the draft in ``draft`` (checked first): the draft's
    method and settings, its draft tokens a step given or the checkpoint's (Eagle-3: its TTT
    steps; P-EAGLE: its parallel tokens; DFlash: block_size - 1; DSpark: block_size)."""
    d = check_draft_dir(draft)
    try:
        return draft_class(d).serve_checkpoint(d, num_speculative_tokens)
    except D.NotServable as e:
        raise DraftError(f"--draft {draft}: {e}") from e
