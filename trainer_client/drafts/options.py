"""A draft's own settings: one dataclass per plug-in (``Draft.Options``), the one place each is
declared. ``hsstream train``'s flags and the ``--config`` file's keys are derived from them
(``hsstream/cli.py``, ``hsstream/train_config.py``), the trainer carries the values it was given
by name (``TrainConfig.draft_options``) and the plug-in reads them back typed (:meth:`parse`).

A setting is a field made with :func:`option`: its name is the config key and, dashed, the flag
(``block_size``: ``--block-size``), as speculators names it; ``flags`` and ``keys`` add other
spellings (speculators' ``--num-layers`` / ``num_layers``). Several drafts may take a setting of
the same name (``mask_token_id``): it is one flag, the same type in each (checked when the
flags are built), each draft with its own default and help. The shared ones are here.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class DraftConfigError(ValueError):
    """A draft's settings cannot work (no mask token, a block size below 2, ...)."""


class DraftOptionError(DraftConfigError):
    """A draft setting is of the wrong type or out of range (the message names the draft)."""


def option(default: Any, *, help: str, flags: tuple[str, ...] = (), keys: tuple[str, ...] = (),  # noqa: A002
           min: float | None = None, why: str | None = None) -> Any:  # noqa: A002  # fmt: skip
    """A draft setting: its default, a one-line ``help`` (the flag's), other flag spellings,
    other config-file keys, a lower bound and why a value below it cannot work."""
    return field(default=default, metadata={"help": help, "flags": tuple(flags), "keys": tuple(keys), "min": min,
                                            "why": why})  # fmt: skip


@dataclass(frozen=True)
class OptionSpec:
    """One setting of one draft, as the CLI and the config file see it."""

    name: str
    type: Any  # int, float, str, bool, or X | None
    default: Any
    help: str
    flags: tuple[str, ...]
    keys: tuple[str, ...]
    min: float | None
    why: str | None = None

    @property
    def base_type(self) -> type:
        """``int`` for ``int | None``."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        return args[0] if args else self.type

    @property
    def all_flags(self) -> tuple[str, ...]:
        return ("--" + self.name.replace("_", "-"), *self.flags)


@dataclass(frozen=True)
class DraftOptions:
    """Base of every draft's options class."""

    @classmethod
    def specs(cls) -> list[OptionSpec]:
        hints = typing.get_type_hints(cls)
        return [OptionSpec(f.name, hints[f.name], f.default, f.metadata.get("help", ""), f.metadata.get("flags", ()),
                           f.metadata.get("keys", ()), f.metadata.get("min"), f.metadata.get("why"))
                for f in dataclasses.fields(cls)]  # fmt: skip

    @classmethod
    def parse(cls, given: Mapping[str, Any], draft: str) -> DraftOptions:
        """The options from ``given`` (settings by name; those of other drafts are left), typed
        and bounded, the rest at their defaults; errors name ``draft`` and the setting."""
        values = {}
        for s in cls.specs():
            if s.name not in given or given[s.name] is None and s.base_type is not s.type:
                continue
            values[s.name] = check_value(s, given[s.name], draft)
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_value(spec: OptionSpec, value: Any, draft: str) -> Any:
    """``value`` as ``spec``'s type, within its bound, or :class:`DraftOptionError`."""
    tp = spec.base_type
    if value is None:
        if tp is spec.type:
            raise DraftOptionError(f"{draft}: {spec.name} needs a value")
        return None
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, int | float) and not isinstance(value, bool) if tp is float else isinstance(value, tp))  # fmt: skip
    if not ok:
        raise DraftOptionError(f"{draft}: {spec.name} {value!r} is not {_what(tp)}")
    if tp is float:
        value = float(value)
    if spec.min is not None and not value >= spec.min:  # NaN too
        raise DraftOptionError(f"{draft}: {spec.name} {value}: {spec.why or f'must be at least {spec.min:g}'}")
    return value


def _what(tp: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, f"a {tp.__name__}")


# ------------------------------------------------------------------------------------------------
# Settings several drafts share (each draft's class lists them by inheriting)
# ------------------------------------------------------------------------------------------------

ATTN_IMPLS = ("sdpa", "eager", "simple_flex_attention")


@dataclass(frozen=True)
class AttentionOptions(DraftOptions):
    draft_attn_impl: str = option("sdpa", help="draft attention: sdpa, eager or simple_flex_attention (GPU only)")


@dataclass(frozen=True)
class ParallelOptions(AttentionOptions):
    """Drafts that fill the positions they draft with a mask token (P-EAGLE, DFlash, DSpark)."""

    mask_token_id: int | None = option(None, help="the mask token id (default: the verifier tokenizer's mask token)")
    max_anchors: int = option(256, min=1, help="anchors sampled per packed row")
