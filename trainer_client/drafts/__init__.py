"""Draft algorithms the generic trainer (``trainer_client/train/``) trains, registered by name.

Each is one module with a :class:`~trainer_client.drafts.base.Draft` subclass; the registry
maps ``hsstream train --draft NAME`` (``draft:`` in the config file) to it and imports the module
only when asked, so the trainer never imports a draft by name and speculators is loaded only
when a draft is built. Adding a draft: one module here, one line in ``REGISTRY``, its tests.
"""

from __future__ import annotations

import importlib

from trainer_client.drafts.base import Draft, DraftConfigError, MissingLayersError

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


__all__ = ["REGISTRY", "Draft", "DraftConfigError", "MissingLayersError", "UnknownDraftError", "get", "names"]
