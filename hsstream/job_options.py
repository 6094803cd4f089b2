"""The job options ``hsstream submit`` and ``hsstream train --submit`` take as flags.

Both commands name the sidecar's ``JobOptions`` (``connector/contract/rest.py``) the same way,
and ``hsstream train --config`` takes the same names as keys (``hsstream/train_config.py``):

* ``--on-invalid skip|reject`` → ``on_invalid``, **skip** unless given: a row no trainer can use
  is counted per reason and the others are queued (a dataset as shipped has such rows);
* ``--max-tokens-per-sample N`` → ``max_tokens_per_sample``; ``--overlong truncate|reject`` →
  ``overlong``;
* ``--chat-template-kwargs JSON`` → ``chat_template_kwargs`` (a JSON object);
* ``--mode extract|regenerate`` → ``mode``; with ``regenerate`` only, how vLLM writes the new
  replies: ``--temperature``, ``--top-p``, ``--max-new-tokens``, ``--sampling-seed`` →
  ``sampling.temperature``, ``.top_p``, ``.max_tokens``, ``.seed``.

``hsstream submit --options JSON`` still takes any option; a flag given on the command line
wins over the same option there. Everything is checked against ``JobOptions`` before a row is
read, so a bad value is one line and nothing is uploaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: The flags' names (as ``hsstream train --config`` keys) → where each goes in ``JobOptions``.
FLAGS: dict[str, tuple[str, ...]] = {
    "on_invalid": ("on_invalid",),
    "max_tokens_per_sample": ("max_tokens_per_sample",),
    "overlong": ("overlong",),
    "chat_template_kwargs": ("chat_template_kwargs",),
    "mode": ("mode",),
    "temperature": ("sampling", "temperature"),
    "top_p": ("sampling", "top_p"),
    "max_new_tokens": ("sampling", "max_tokens"),
    "sampling_seed": ("sampling", "seed"),
}
SAMPLING_FLAGS = ("temperature", "top_p", "max_new_tokens", "sampling_seed")
#: What ``on_invalid`` is when neither a flag nor ``--options`` sets it: a dataset as shipped has
#: rows no trainer can use (ShareGPT V3: empty conversations), and one of them should not refuse
#: the other 17,000.
DEFAULT_ON_INVALID = "skip"


class JobOptionsError(ValueError):
    """Options that the sidecar would refuse: one line, before anything is read or sent."""


def parse_kwargs(value: str | Mapping[str, Any] | None, where: str = "--chat-template-kwargs") -> dict | None:
    """A JSON object given as text (a flag) or as a mapping (a config file)."""
    if value is None or isinstance(value, Mapping):
        return dict(value) if value is not None else None
    try:
        out = json.loads(value)
    except ValueError as e:
        raise JobOptionsError(f"{where}: not JSON ({e})") from None
    if not isinstance(out, dict):
        raise JobOptionsError(f"{where}: a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return out


def build(base: str | Mapping[str, Any] | None = None, **flags: Any) -> dict:
    """The job's options: ``base`` (``--options``' JSON, or a mapping), then every flag that was
    given (not None) over it, ``on_invalid`` defaulting to skip; checked against ``JobOptions``
    and returned as the dict the upload sends (only what was set)."""
    from pydantic import ValidationError

    from connector.contract.rest import JobOptions

    if isinstance(base, str):
        try:
            opts = json.loads(base or "{}")
        except ValueError as e:
            raise JobOptionsError(f"--options: not JSON ({e})") from None
        if not isinstance(opts, dict):
            raise JobOptionsError("--options: a JSON object, e.g. '{\"epochs\": 2}'")
    else:
        opts = dict(base or {})
    unknown = sorted(set(flags) - set(FLAGS) - {"epochs", "loss_mask"})
    if unknown:
        raise TypeError(f"no such job option flag: {', '.join(unknown)}")
    given = {k: v for k, v in flags.items() if v is not None}
    if "chat_template_kwargs" in given:
        given["chat_template_kwargs"] = parse_kwargs(given["chat_template_kwargs"])
    mode = given.get("mode", opts.get("mode", "extract"))
    sampling = [k for k in SAMPLING_FLAGS if k in given]
    if sampling and mode != "regenerate":
        names = ", ".join("--" + k.replace("_", "-") for k in sampling)
        raise JobOptionsError(f"{names}: how vLLM writes a new reply, so only with --mode regenerate")
    for k, v in given.items():
        path = FLAGS.get(k, (k,))
        if len(path) == 1:
            opts[path[0]] = v
        else:
            opts[path[0]] = {**(opts.get(path[0]) or {}), path[1]: v}
    opts.setdefault("on_invalid", DEFAULT_ON_INVALID)
    try:
        JobOptions.model_validate(opts)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "options"
        raise JobOptionsError(f"job option {where}: {first['msg']} (got {first.get('input')!r})") from None
    return opts
