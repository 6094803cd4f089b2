"""``hsstream``: one entry point for every role; heavy imports happen inside each command."""

from __future__ import annotations

import os
import sys

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Hidden-state streaming for online Eagle-3 training.")


@app.command()
def serve(host: str = typer.Option(None), port: int = typer.Option(None)) -> None:
    """Run the sidecar (REST + notice + delivery endpoints)."""
    import uvicorn

    from connector.settings import Settings
    from server.app import create_app

    s = Settings()
    uvicorn.run(create_app(s), host=host or s.host, port=port or s.port, log_level="warning")


@app.command()
def vllm(
    model: str = typer.Option(None, help="verifier checkpoint (default HSSTREAM_MODEL)"),
    layer_ids: str = typer.Option(None, help="comma-separated layer ids (default HSSTREAM_LAYER_IDS)"),
    port: int = typer.Option(8000),
    host: str = typer.Option("0.0.0.0"),
    max_model_len: int = typer.Option(None),
    gpu_memory_utilization: float = typer.Option(None),
    enforce_eager: bool = typer.Option(False),
    prefix_caching: bool = typer.Option(False),
    dry_run: bool = typer.Option(False, help="print the command instead of running it"),
) -> None:
    """Exec `vllm serve` with the extraction method and our connector (what compose runs)."""
    from connector.layers import LayerIdError
    from connector.settings import Settings
    from hsstream import launch

    s = Settings()
    mdl = model or s.model
    if not mdl:
        raise typer.BadParameter("no model: pass --model or set HSSTREAM_MODEL")
    ids = [int(x) for x in layer_ids.replace(",", " ").split()] if layer_ids else s.layer_ids
    if not ids:
        n = launch.num_hidden_layers(mdl)
        if n is None:
            raise typer.BadParameter("no layer ids and no local config.json to choose defaults from")
        ids = launch.default_layer_ids(n)
    opts = launch.VllmOptions(
        model=mdl, layer_ids=ids, spool_dir=str(s.spool_dir), notice_endpoint=s.notice_ep(), port=port, host=host,
        max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
        prefix_caching=prefix_caching, num_writer_threads=s.num_writer_threads,
    )  # fmt: skip
    try:
        args = launch.vllm_args(opts)
    except LayerIdError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if dry_run:
        typer.echo(" ".join(args))
        return
    env = launch.child_env()
    os.execvpe(args[0], args, env)


@app.command()
def demo(prompts: int = typer.Option(32, help="number of samples to stream"), workdir: str = typer.Option(None)) -> None:
    """Run the whole loop on the embedded tiny model (CPU): vLLM → spool → sidecar → stream."""
    from hsstream.demo import run_demo

    raise typer.Exit(run_demo(prompts, workdir))


@app.command()
def submit(
    file: str = typer.Argument(..., help="JSONL: one sample per line ({prompt|messages|conversations|token_ids, id})"),
    options: str = typer.Option("{}", help='job options as JSON, e.g. \'{"epochs": 2, "loss_mask": "all"}\''),
    follow: bool = typer.Option(False, "--follow", help="show progress until the job ends"),
    url: str = typer.Option(None, help="sidecar URL (default http://HSSTREAM_HOST:HSSTREAM_PORT)"),
) -> None:
    """Submit a JSONL file as a job; prints the job id."""
    from hsstream.rest_client import submit as _submit

    raise typer.Exit(_submit(file, options, url, follow))


@app.command()
def status(job: str = typer.Argument(None), url: str = typer.Option(None)) -> None:
    """Show one job's progress, or list all jobs."""
    from hsstream.rest_client import status as _status

    raise typer.Exit(_status(job, url))


def main() -> None:
    app(prog_name="hsstream")


if __name__ == "__main__":
    sys.exit(main())
