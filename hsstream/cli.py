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
    vllm_args: list[str] = typer.Argument(None, help="more vLLM arguments after `--`, e.g. -- --tensor-parallel-size 2"),
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
        prefix_caching=prefix_caching, num_writer_threads=s.num_writer_threads, extra=list(vllm_args or []),
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


@app.command()
def up(
    env_file: str = typer.Option(None, help="compose's .env (e.g. deploy/.env); the shell's environment wins"),
    model: str = typer.Option(None, help="verifier checkpoint dir (default HSSTREAM_MODEL or MODEL_DIR, else the tiny model)"),
    layer_ids: str = typer.Option(None, help="comma-separated layer ids (default HSSTREAM_LAYER_IDS, else Eagle-3's)"),
    with_trainer: bool = typer.Option(False, "--with-trainer", help="also run `hsstream train`"),
    trainer_cmd: str = typer.Option(None, help="run this command as the trainer instead (shell syntax)"),
    max_restarts: int = typer.Option(3, min=0, help="restarts of a vLLM that dies before `up` gives up"),
    max_model_len: int = typer.Option(None, help="default MAX_MODEL_LEN, else the model's"),
    gpu_memory_utilization: float = typer.Option(None, help="default GPU_MEMORY_UTILIZATION; 0.2 on the CPU build"),
    enforce_eager: bool = typer.Option(None, "--enforce-eager/--no-enforce-eager", help="default: eager on CPU"),
    prefix_caching: bool = typer.Option(False, help="see docs/prefix-caching.md"),
    ready_timeout: float = typer.Option(900.0, help="seconds vLLM may take to load the model"),
    log_dir: str = typer.Option(None, help="also write each child's log to DIR/NAME.log"),
    vllm_args: list[str] = typer.Argument(None, help="more vLLM arguments after `--`"),
) -> None:
    """Start vLLM, the sidecar and optionally a trainer; supervise them until Ctrl-C or SIGTERM."""
    import shlex

    from hsstream import up as _up

    sup_say = lambda m: typer.echo(f"up      | {m}", err=True)  # noqa: E731
    if with_trainer and trainer_cmd:
        raise typer.BadParameter("give --with-trainer or --trainer-cmd, not both")
    tcmd = shlex.split(trainer_cmd) if trainer_cmd else None
    if with_trainer:
        if "train" not in typer.main.get_command(app).commands:  # type: ignore[attr-defined]
            typer.echo("error: this install has no `hsstream train`; pass --trainer-cmd instead", err=True)
            raise typer.Exit(2)
        tcmd = [sys.executable, "-m", "hsstream", "train"]
    try:
        cfg = _up.build_config(
            env_file=env_file, model=model, layer_ids=layer_ids, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, prefix_caching=prefix_caching,
            vllm_extra=vllm_args, trainer_cmd=tcmd, max_restarts=max_restarts, ready_timeout_s=ready_timeout,
            log_dir=log_dir, say=sup_say,
        )  # fmt: skip
    except _up.UpError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    raise typer.Exit(_up.Supervisor(cfg, say=sup_say).run())


def main() -> None:
    app(prog_name="hsstream")


if __name__ == "__main__":
    sys.exit(main())
