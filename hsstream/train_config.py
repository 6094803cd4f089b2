"""``hsstream train --config FILE``: every setting of a run in one YAML or TOML file.

Keys are :class:`TrainConfig`'s field names, each registered draft's own settings (declared in
its plug-in, ``Draft.Options``: ``trainer_client/drafts/``; they go into
``TrainConfig.draft_options``), the run's own settings (``RUN_KEYS``: what to train on and where
the sidecar is), ``hsstream train``'s flag names, or speculators' names for the same thing (``speculators train``'s flags and ``run.yaml`` keys, so a recipe from there needs no
rewriting: ``SPECULATORS_NAMES``). Dashes and underscores are the same. Like speculators'
``--config``, the keys may sit under a top-level ``train:`` and in speculators' group blocks
(``optimizer:``, ``scheduler:``, ...). Unlike it, an unknown key is an error naming the key: a
misspelt setting silently left at its default costs a whole run.

Precedence is flag > file > default; the CLI decides which flags were given (click's parameter
source) and calls :func:`merge`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch comes with it: loaded only once settings are checked, not to read a file
    from trainer_client.train.config import TrainConfig


class ConfigFileError(ValueError):
    """The file cannot be read, or a key or value is not one ``hsstream train`` takes."""


#: Settings of the run beside the trainer's (hsstream/cli.py's flag of the same name).
RUN_KEYS: dict[str, object] = {
    "jobs": list[str],  # job ids to follow
    "submit": str,  # a file or dataset to submit as one job (trainer_client/data_sources.py)
    "submit_preset": str,  # its layout: sharegpt | ultrachat | openai
    "submit_field": list[str],  # NAME=COLUMN mappings
    "submit_split": str,
    "submit_limit": int,
    "submit_shuffle": bool,  # buffer shuffle, seeded with the run's seed
    "epochs": int,
    "loss_mask": str,
    # the job's options with --submit (hsstream/job_options.py): the same names as the flags
    "on_invalid": str,
    "max_tokens_per_sample": int,
    "overlong": str,
    "chat_template_kwargs": dict,
    "mode": str,
    "temperature": float,
    "top_p": float,
    "max_new_tokens": int,
    "sampling_seed": int,
    "api": str,
    "endpoint": str,
    "spool": str,
    "token_counts": str,
    "timeout": float,
    "nproc": int,
    "follow": bool,  # every job of the sidecar as it comes, no end (the live-traffic loop)
    "mix": str,  # with follow: a file or dataset whose rows are kept at mix_share of the stream
    "mix_share": float,
}

#: ``hsstream train``'s flags whose name is not the field's.
FLAG_NAMES: dict[str, str] = {
    "model": "verifier",
    "out": "out_dir",
    "job": "jobs",
    "steps": "max_steps",
    "warmup": "warmup_steps",
    "aux_layers": "aux_layer_ids",
}

#: speculators' names (``speculators train`` flags / ``run.yaml`` keys) for the same settings.
SPECULATORS_NAMES: dict[str, str] = {
    "verifier_name_or_path": "verifier",
    "save_path": "out_dir",
    "target_layer_ids": "aux_layer_ids",
    "scheduler_type": "schedule",
    "scheduler_warmup_steps": "warmup_steps",
    "scheduler_total_steps": "schedule_steps",
    "total_seq_len": "max_tokens_per_step",
    "log_freq": "log_every",
    "speculator_type": "draft",
    # same name in both: max_steps, lr, weight_decay, draft_vocab_size, seed, epochs; the drafts'
    # settings carry their speculators names themselves (trainer_client/drafts/options.py)
}

#: speculators' ``run.yaml`` group blocks: their keys are read as if at the top level.
SPECULATORS_GROUPS = frozenset({"verifier", "draft", "data", "generation", "loss", "optimizer", "scheduler",
                                "trainer", "logging", "dflash", "peagle", "dspark"})  # fmt: skip

#: Values speculators spells differently.
VALUE_ALIASES: dict[str, dict[object, object]] = {"schedule": {"none": "constant"}}

@functools.cache
def fields() -> dict[str, object]:
    """``TrainConfig``'s fields and their types (the drafts' settings apart: :func:`draft_keys`)."""
    from trainer_client.train.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    hints.pop("draft_options")
    return hints


@functools.cache
def draft_keys() -> dict[str, object]:
    """Every registered draft's settings, by name, and their types (the registry checks that a
    name several drafts take has one type)."""
    from trainer_client import drafts

    return {name: owners[0][1].type for name, owners in drafts.option_table().items()}


@functools.cache
def draft_aliases() -> dict[str, str]:
    """Other spellings of the drafts' settings (speculators' ``num_layers``, ``--num-layers``)."""
    from trainer_client import drafts

    out = {}
    for name, owners in drafts.option_table().items():
        for _, spec in owners:
            for alias in (*spec.keys, *(f.lstrip("-").replace("-", "_") for f in spec.flags)):
                out[alias] = name
    return out


def keys() -> dict[str, object]:
    """Every setting a file may hold, by canonical name, and its type."""
    return {**fields(), **draft_keys(), **RUN_KEYS}


def canonical(key: str) -> str | None:
    """The setting ``key`` names (a field, a draft's setting or a run key), or None."""
    k = key.strip().replace("-", "_")
    k = FLAG_NAMES.get(k, SPECULATORS_NAMES.get(k, k))
    k = k if k in fields() or k in RUN_KEYS else draft_aliases().get(k, k)
    return k if k in keys() else None


def read(path: str | Path) -> dict:
    """The file's settings by canonical name, values checked and converted; errors name the key."""
    return settings(load_mapping(path), where=f"--config {path}")


def load_mapping(path: str | Path) -> dict:
    """The file's mapping as written (under ``train:`` if it has one); nothing checked yet."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigFileError(f"--config {p}: cannot read it: {e.strerror or e}") from e
    if p.suffix.lower() == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigFileError(f"--config {p}: not valid TOML: {e}") from e
    else:  # .yaml / .yml, and JSON (a YAML document too)
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigFileError(f"--config {p}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {p}: the file must hold a mapping of settings, not {type(data).__name__}")
    if isinstance(data.get("train"), dict):
        data = data["train"]
    return data


def settings(data: dict, *, where: str = "--config") -> dict:
    """``data`` (keys by any accepted name, speculators' groups flattened) by canonical name."""
    flat: list[tuple[str, str, object]] = []  # (as written, its path, value)
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k in SPECULATORS_GROUPS and isinstance(value, dict):
            flat.extend((str(sub), f"{key}.{sub}", v) for sub, v in value.items())
        else:
            flat.append((str(key), str(key), value))
    out: dict = {}
    seen: dict[str, str] = {}
    unknown = []
    for key, path, value in flat:
        name = canonical(key)
        if name is None:
            unknown.append(path)
            continue
        if name in seen:
            raise ConfigFileError(f"{where}: {path!r} and {seen[name]!r} both set {name}")
        seen[name] = path
        out[name] = coerce(name, value, where=f"{where}: {path}")
    if unknown:
        raise ConfigFileError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                              f"(see docs/trainer.md, 'Configuration file', for the keys)")  # fmt: skip
    return out


def _split(value: object, strings: bool = False) -> list:
    """A list as written in the file or on the command line ("2,6,9", "2 6 9"; ids: commas only)."""
    if isinstance(value, str):
        return [x.strip() for x in (value.split(",") if strings else value.replace(",", " ").split()) if x.strip()]
    if isinstance(value, list | tuple):
        return list(value)
    raise TypeError("a list (or a comma-separated string)")


def _scalar(tp: type, value: object) -> object:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise TypeError("true or false")
    if tp in (int, float):
        what = "an integer" if tp is int else "a number"
        wrong = isinstance(value, bool) or not isinstance(value, int | float | str)
        if wrong or (tp is int and isinstance(value, float)):
            raise TypeError(what)
        try:
            return tp(value)
        except ValueError:
            raise TypeError(what) from None
    if tp is str:
        if not isinstance(value, str):
            raise TypeError("a string")
        return value
    if tp is dict:
        if isinstance(value, str):  # a flag: JSON text
            try:
                value = json.loads(value)
            except ValueError:
                raise TypeError("a mapping (JSON text of an object)") from None
        if not isinstance(value, dict):
            raise TypeError("a mapping")
        return dict(value)
    raise TypeError(f"a {tp}")


def coerce(name: str, value: object, *, where: str | None = None) -> object:
    """``value`` as setting ``name``'s type (``TrainConfig``'s annotation, or ``RUN_KEYS``')."""
    tp = keys()[name]
    value = VALUE_ALIASES.get(name, {}).get(value, value) if isinstance(value, str) else value
    try:
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            if value is None:
                return None
            (tp,) = [a for a in args if a is not type(None)]
            args = typing.get_args(tp)
        origin = typing.get_origin(tp)
        if origin is list:
            return [_scalar(args[0], v) for v in _split(value, args[0] is str)]
        if origin is tuple:
            items = _split(value, args[0] is str)
            if args[-1] is Ellipsis:
                kinds = [args[0]] * len(items)
            elif len(items) == len(args):
                kinds = list(args)
            else:
                raise TypeError(f"{len(args)} values")
            return tuple(_scalar(k, x) for k, x in zip(kinds, items, strict=True))
        if value is None:
            raise TypeError("a value (null is not one)")
        return _scalar(tp, value)
    except (TypeError, ValueError) as e:
        raise ConfigFileError(f"{where or name}: {value!r} is not {e}") from e


def merge(defaults: dict, file: dict, given: dict) -> tuple[TrainConfig, dict]:
    """flag > file > default: the :class:`TrainConfig` and the run's settings (``RUN_KEYS``).

    ``defaults`` and ``given`` are the CLI's values by canonical name, split by whether the flag
    was on the command line; fields in none of the three keep ``TrainConfig``'s default."""
    v = {**defaults, **file, **given}
    needed = (("verifier", "no verifier: pass --model, set HSSTREAM_MODEL or verifier in --config"),
              ("out_dir", "no run dir: pass --out or set out_dir in --config"))
    missing = [m for k, m in needed if not v.get(k)]
    if missing:
        raise ConfigFileError("; ".join(missing))
    if v.get("schedule", "cosine") not in SCHEDULES:
        raise ConfigFileError(f"schedule {v['schedule']!r}: use one of {', '.join(SCHEDULES)}")
    from trainer_client.train.config import TrainConfig

    cfg = TrainConfig(**{k: v[k] for k in fields() if k in v},
                      draft_options={k: v[k] for k in draft_keys() if k in v and v[k] is not None})  # fmt: skip
    return cfg, {k: v[k] for k in RUN_KEYS if k in v}


SCHEDULES = ("cosine", "linear", "constant")


def dump(cfg: TrainConfig, run: dict) -> str:
    """The resolved settings as a YAML file ``--config`` reads back (``--dump-config``): the draft's
    settings at the top level, each of the chosen draft's resolved (its defaults included)."""
    import yaml

    from trainer_client import drafts

    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "draft_options"}
    d.update(cfg.draft_options)
    try:
        d.update(drafts.get(cfg.draft).Options.parse(cfg.draft_options, cfg.draft).as_dict())
    except (drafts.UnknownDraftError, drafts.DraftConfigError):
        pass  # the run itself will say so
    d = json.loads(json.dumps({**d, **run}, default=list))  # tuples → lists, plain types only
    d["extra"] = {k: v for k, v in d.get("extra", {}).items() if k != "argv"}
    return yaml.safe_dump(d, sort_keys=False)
