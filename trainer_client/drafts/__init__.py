"""Draft algorithms the generic trainer (``trainer_client/train/``) trains, registered by name.

Each is one module with a :class:`~trainer_client.drafts.base.Draft` subclass: what it reads
from the stream, how it is built, trained and checked, its settings (``Draft.Options``: the
flags and config keys ``hsstream train`` takes for it, :func:`option_table`) and how vLLM serves
its checkpoints (``Draft.serve_config``: ``hsstream eval``, the launcher and the trainer's serve
line ask it, :mod:`trainer_client.drafts.serving`). The registry maps ``hsstream train --draft
NAME`` (``draft:`` in the config file) to it and imports the module only when asked, so the
trainer never imports a draft by name and speculators is loaded only when a draft is built.
Adding a draft: one module here, one line in ``REGISTRY``, its tests.
"""

from __future__ import annotations

import importlib

from trainer_client.drafts.base import Draft, DraftConfigError, MissingLayersError, NotServable
from trainer_client.drafts.options import OptionSpec

#: name → "module:class"
REGISTRY: dict[str, str] = {
    "eagle3": "trainer_client.drafts.eagle3:Eagle3",
    "dflash": "trainer_client.drafts.dflash:DFlash",
    "dspark": "trainer_client.drafts.dspark:DSpark",
    "peagle": "trainer_client.drafts.peagle:PEagle",
}


class UnknownDraftError(ValueError):
    """A draft name no module is registered for."""


def names() -> list[str]:
    return sorted(REGISTRY)


def get(name: str) -> type[Draft]:
    """The draft class registered as ``name`` (case-insensitive)."""
    key = (name or "").strip().lower()
    if key not in REGISTRY:
        raise UnknownDraftError(f"unknown draft {name!r}: use one of {', '.join(names())}")
    mod, cls = REGISTRY[key].split(":")
    return getattr(importlib.import_module(mod), cls)


def option_table() -> dict[str, list[tuple[str, OptionSpec]]]:
    """Every registered draft's settings by name: (draft, its spec of it) for each draft that
    takes it. A name several drafts take must have one type in all of them (one flag, one key)."""
    table: dict[str, list[tuple[str, OptionSpec]]] = {}
    for name in names():
        for spec in get(name).Options.specs():
            table.setdefault(spec.name, []).append((name, spec))
    for opt, owners in table.items():
        types = {str(s.type) for _, s in owners}
        if len(types) > 1:
            raise DraftConfigError(f"draft setting {opt!r} has different types in " +
                                   ", ".join(f"{d} ({s.type})" for d, s in owners))  # fmt: skip
        flags = {s.all_flags for _, s in owners}
        if len(flags) > 1:
            raise DraftConfigError(f"draft setting {opt!r} has different flags in {', '.join(d for d, _ in owners)}")
    return table


def draft_for_checkpoint(config: dict) -> type[Draft] | None:
    """The registered draft whose checkpoints look like ``config`` (a ``config.json``): by its
    ``speculators_model_type`` first, then by what a draft recognises in older checkpoints."""
    classes = [get(n) for n in names()]
    t = config.get("speculators_model_type")
    for cls in classes:
        if t is not None and t == cls.speculators_type:
            return cls
    return next((cls for cls in classes if cls.holds(config)), None)


__all__ = ["REGISTRY", "Draft", "DraftConfigError", "MissingLayersError", "NotServable", "UnknownDraftError",
           "draft_for_checkpoint", "get", "names", "option_table"]  # fmt: skip
