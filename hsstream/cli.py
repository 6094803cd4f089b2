"""``hsstream``: one entry point for every role; heavy imports happen inside each command."""

from __future__ import annotations

import os
import sys

import typer

from hsstream.assets_cli import data_app, model_path as _model_path, models_app  # typer only at import
from hsstream.cli_text import (H_KWARGS, H_MAX_NEW, H_MAX_TOKENS, H_MODE, H_ON_INVALID, H_OVERLONG, H_SAMPLING_SEED,
                               H_TEMPERATURE, H_TOP_P)

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="Hidden-state streaming for online Eagle-3 training.")
app.add_typer(models_app, name="models")
app.add_typer(data_app, name="data")


@app.command()
def serve(
    host: str = typer.Option(None, help="address to bind the REST API (default HSSTREAM_HOST)"),
    port: int = typer.Option(None, help="REST API port (default HSSTREAM_PORT)"),
    insecure_no_token: bool = typer.Option(
        False, "--insecure-no-token", help="serve without HSSTREAM_API_TOKEN on a non-loopback address (as HSSTREAM_ALLOW_OPEN=1)"
    ),
) -> None:
    """Run the sidecar: REST API, notice and delivery endpoints.

    Off 127.0.0.1 it needs HSSTREAM_API_TOKEN (or --insecure-no-token)."""
    from hsstream.extras import needs_extra

    with needs_extra("server", "hsstream serve"):
        import uvicorn

        from server.app import create_app
        from server.connections import connection_limit, protocol_class
        from server.instance_lock import AlreadyRunning, bind_rest
    from connector import protocol as P
    from connector.contract.api_token import TokenFileError
    from connector.contract.arena import ArenaError
    from connector.contract.curve_keys import InsecureKeyFile
    from connector.contract.settings import Settings
    from hsstream import launch
    from hsstream.exposure import OpenBindRefused, check_api_exposure

    from connector import layouts

    s = Settings()
    if insecure_no_token:
        s = s.model_copy(update={"allow_open": True})
    s.model = _model_path(s.model)
    try:  # a name the layouts' registry does not hold: one line, before anything is bound or made
        layouts.layout(s.spool_layout)
    except ValueError as e:
        typer.echo(f"error: HSSTREAM_SPOOL_LAYOUT: {e}", err=True)
        raise typer.Exit(2) from e
    bind = host or s.host
    try:
        warning = check_api_exposure(bind, s.api_token, s.allow_open)
    except OpenBindRefused as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if warning:
        typer.echo(warning, err=True)
    if s.allow_open and not s.api_token:
        typer.echo("WARNING: the REST API is served without a token (HSSTREAM_ALLOW_OPEN / --insecure-no-token): "
                   "every local user can read and submit jobs", err=True)  # fmt: skip
    # uvicorn stops gracefully on SIGTERM, then re-raises it to the handler it found, to die by
    # it (exit 143) although the stop was clean: this handler makes that exit status 0.
    launch.exit_0_on_stop()
    the_port = port or s.port
    try:
        # The port first, then the locks (in create_app), then the ledger, arena and sockets: a
        # second sidecar stops before it touches anything of the first one's (server/instance_lock.py).
        sock = bind_rest(bind, the_port, s)
        app_ = create_app(s, rest=f"http://{bind}:{sock.getsockname()[1]}")
    except (P.SpoolNotOurs, InsecureKeyFile, ArenaError, AlreadyRunning, TokenFileError) as e:  # ArenaError: a tmpfs too small for it
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    # Slow, idle and surplus connections are closed (server/connections.py).
    http = protocol_class(s.http_header_timeout_s, connection_limit(s))
    config = uvicorn.Config(app_, host=bind, port=the_port, log_level="warning", http=http,
                            timeout_keep_alive=s.http_idle_timeout_s)  # fmt: skip
    uvicorn.Server(config).run(sockets=[sock])


@app.command()
def vllm(
    model: str = typer.Option(None, help="verifier checkpoint dir or short name, e.g. smollm2 (default HSSTREAM_MODEL)"),
    layer_ids: str = typer.Option(None, help="comma-separated layer ids (default HSSTREAM_LAYER_IDS)"),
    port: int = typer.Option(8000, help="vLLM's HTTP port"),
    host: str = typer.Option("127.0.0.1", help="address vLLM binds (its API has no token: 0.0.0.0 only on a private network)"),
    max_model_len: int = typer.Option(None, help="context length (default: the model's)"),
    gpu_memory_utilization: float = typer.Option(None, help="share of GPU memory vLLM may use (0.2 on CPU)"),
    enforce_eager: bool = typer.Option(False, help="no CUDA graphs / compilation", show_default=False),
    prefix_caching: bool = typer.Option(False, help="off by default: see docs/prefix-caching.md", show_default=False),
    dry_run: bool = typer.Option(False, help="print the command instead of running it"),
    vllm_args: list[str] = typer.Argument(None, help="more vLLM arguments after `--` (see `vllm serve --help`)"),
) -> None:
    """Run vLLM with the extraction method and our connector.

    It execs `vllm serve` with the command line compose runs too."""
    from connector.contract.settings import Settings
    from connector.layers import LayerIdError
    from hsstream import launch

    s = Settings()
    mdl = _model_path(model or s.model)
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
        prefix_caching=prefix_caching, num_writer_threads=s.num_writer_threads, layer_order=s.layer_order, extra=list(vllm_args or []),
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
    if launch.is_cpu_build() and env.get("VLLM_CPU_OMP_THREADS_BIND") != "nobind":
        from hsstream import numa_calls

        line = numa_calls.explain(numa_calls.refused())
        if line:
            typer.echo(line, err=True)
    os.execvpe(args[0], args, env)


@app.command()
def demo(
    prompts: int = typer.Option(32, help="number of samples to stream"),
    workdir: str = typer.Option(None, help="keep files here (default: a temp dir)"),
    model: str = typer.Option("smollm2", help="verifier checkpoint dir or short name; 'tiny': the tiny test verifier"),
) -> None:
    """Stream samples from a verifier on CPU, end to end.

    vLLM → spool → sidecar → HiddenStateStream, with a summary."""
    from hsstream.demo import run_demo

    raise typer.Exit(run_demo(prompts, workdir, model if model == "tiny" else _model_path(model)))


#: The job-option flags of `submit` and `train` (hsstream/job_options.py), one help text each.


@app.command()
def submit(
    file: str = typer.Argument(..., help="samples: JSONL (.jsonl, .jsonl.gz), a JSON array (.json), parquet, "
                                         "arrow/feather, a datasets save_to_disk folder, or a datasets name (with --split)"),
    options: str = typer.Option("{}", help='job options as JSON, e.g. \'{"epochs": 2, "loss_mask": "all"}\''),
    follow: bool = typer.Option(False, "--follow", help="show progress until the job ends"),
    url: str = typer.Option(None, help="sidecar URL (default http://HSSTREAM_HOST:HSSTREAM_PORT)"),
    preset: str = typer.Option(None, help="the rows' layout: sharegpt | ultrachat | openai (speculators' column names)"),
    field: list[str] = typer.Option(None, "--field", help="NAME=COLUMN: take sample field NAME (id, prompt, messages, "
                                                          "conversations, token_ids, tools) from COLUMN (repeatable)"),
    split: str = typer.Option(None, help="the datasets split (a DatasetDict folder, or a datasets name)"),
    limit: int = typer.Option(None, min=0, help="send at most N samples"),
    shuffle: bool = typer.Option(False, "--shuffle", help="shuffle through a buffer of --shuffle-buffer rows "
                                                          "(uniform when the buffer holds the whole source)"),
    shuffle_buffer: int = typer.Option(10_000, min=1, help="rows held by --shuffle"),
    seed: int = typer.Option(0, help="--shuffle's seed"),
    on_invalid: str = typer.Option(None, help=H_ON_INVALID),
    max_tokens_per_sample: int = typer.Option(None, min=1, help=H_MAX_TOKENS),
    overlong: str = typer.Option(None, help=H_OVERLONG),
    chat_template_kwargs: str = typer.Option(None, help=H_KWARGS),
    mode: str = typer.Option(None, help=H_MODE),
    temperature: float = typer.Option(None, help=H_TEMPERATURE),
    top_p: float = typer.Option(None, help=H_TOP_P),
    max_new_tokens: int = typer.Option(None, help=H_MAX_NEW),
    sampling_seed: int = typer.Option(None, help=H_SAMPLING_SEED),
) -> None:
    """Submit a file or dataset as one job; prints the job id.

    The rows are read and uploaded as a stream (JSONL made on the fly): memory stays flat. Rows
    no trainer can use are skipped and counted per reason (--on-invalid reject refuses the job)."""
    from hsstream.rest_client import submit as _submit

    flags = {"on_invalid": on_invalid, "max_tokens_per_sample": max_tokens_per_sample, "overlong": overlong,
             "chat_template_kwargs": chat_template_kwargs, "mode": mode, "temperature": temperature, "top_p": top_p,
             "max_new_tokens": max_new_tokens, "sampling_seed": sampling_seed}  # fmt: skip
    raise typer.Exit(_submit(file, options, url, follow, preset=preset, fields=field, split=split, limit=limit,
                             shuffle=shuffle, seed=seed, shuffle_buffer=shuffle_buffer, job_flags=flags))  # fmt: skip


@app.command()
def status(
    job: str = typer.Argument(None, help="job id (default: list all jobs)"),
    url: str = typer.Option(None, help="sidecar URL (default http://HSSTREAM_HOST:HSSTREAM_PORT)"),
) -> None:
    """Show one job's progress, or list all jobs."""
    from hsstream.rest_client import status as _status

    raise typer.Exit(_status(job, url))


@app.command()
def token() -> None:
    """Print the sidecar's REST token, as the hsstream commands send it.

    HSSTREAM_API_TOKEN, else the one the sidecar made in its run dir (HSSTREAM_RUN_DIR), e.g.
    for curl: -H "authorization: Bearer $(hsstream token)"."""
    from connector.contract.api_token import TokenFileError, client_token, token_path
    from connector.contract.settings import Settings

    s = Settings()
    try:
        tok = client_token(s.api_token, s.run_dir)
    except TokenFileError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if not tok:
        typer.echo(f"no token: HSSTREAM_API_TOKEN is unset and {token_path(s.run_dir)} does not exist (is the "
                   "sidecar running with this HSSTREAM_RUN_DIR?)", err=True)  # fmt: skip
        raise typer.Exit(1)
    typer.echo(tok)


@app.command()
def top(
    url: str = typer.Option(None, help="sidecar URL (default http://HSSTREAM_HOST:HSSTREAM_PORT)"),
    interval: float = typer.Option(1.0, min=0.2, help="seconds between refreshes"),
    once: bool = typer.Option(False, "--once", help="print one frame and exit (scripts, logs)"),
    proxy: str = typer.Option(None, help="also show the live draft of the serving proxy at this URL "
                              "(hsstream proxy serve)"),
) -> None:
    """Live view: jobs, samples/s, spool fill, trainers' wait share.

    Refreshed every second from the sidecar's GET /v1/overview; Ctrl-C quits."""
    from hsstream.top import run_top

    raise typer.Exit(run_top(url, interval, once, proxy))


@app.command()
def up(
    env_file: str = typer.Option(None, help="compose's .env (e.g. deploy/.env); the shell's environment wins"),
    model: str = typer.Option(None, help="verifier checkpoint dir or short name (default HSSTREAM_MODEL or MODEL_DIR, "
                                          "else smollm2: `hsstream models get smollm2` fetches it)"),
    layer_ids: str = typer.Option(None, help="comma-separated layer ids (default HSSTREAM_LAYER_IDS, else Eagle-3's)"),
    train: str = typer.Option(None, help="also run `hsstream train` with these arguments, e.g. \"--out runs/a --submit data.jsonl\""),
    trainer_cmd: str = typer.Option(None, help="or run this command as the trainer (shell syntax)"),
    max_restarts: int = typer.Option(3, min=0, help="restarts of dead vLLM engines (together), and of the sidecar, before `up` gives up"),
    max_model_len: int = typer.Option(None, help="default MAX_MODEL_LEN, else the model's"),
    gpu_memory_utilization: float = typer.Option(None, help="default GPU_MEMORY_UTILIZATION; 0.2 on the CPU build"),
    enforce_eager: bool = typer.Option(None, "--enforce-eager/--no-enforce-eager", help="default: eager on CPU"),
    prefix_caching: bool = typer.Option(False, help="off by default: see docs/prefix-caching.md", show_default=False),
    ready_timeout: float = typer.Option(900.0, help="seconds vLLM may take to load the model"),
    log_dir: str = typer.Option(None, help="also write each child's log to DIR/NAME.log"),
    engines: int = typer.Option(1, min=1, help="vLLM engines (processes) on ports VLLM_PORT, +1, ...; the sidecar "
                                              "spreads samples over them (CPU build: the cores split between them)"),
    vllm_args: list[str] = typer.Argument(None, help="more vLLM arguments after `--`"),
) -> None:
    """Start vLLM, the sidecar and a trainer; stop all on Ctrl-C.

    Supervises them (restarts a dead vLLM or sidecar) until Ctrl-C or SIGTERM."""
    import shlex

    from hsstream import up as _up

    def sup_say(msg: str) -> None:
        typer.echo("\n".join(f"up      | {line}" for line in msg.splitlines()), err=True)

    if train is not None and trainer_cmd:
        raise typer.BadParameter("give --train or --trainer-cmd, not both")
    tcmd = shlex.split(trainer_cmd) if trainer_cmd else None
    if train is not None:  # checked now, not after vLLM has loaded for a minute
        train_cmd = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
        try:
            with train_cmd.make_context("hsstream train", shlex.split(train)) as tctx:
                if not tctx.params.get("out") and not tctx.params.get("config"):
                    raise typer.BadParameter("no run dir: pass --out (or --config with out_dir)")
        except typer.TyperException as e:  # typer's own click: a usage error, bad option or value
            typer.echo(f"error: --train {train!r}: {getattr(e, 'format_message', e.__str__)()}", err=True)
            raise typer.Exit(2) from e
        tcmd = [sys.executable, "-m", "hsstream", "train", *shlex.split(train)]
    try:
        cfg = _up.build_config(
            env_file=env_file, model=model, layer_ids=layer_ids, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, prefix_caching=prefix_caching,
            vllm_extra=vllm_args, trainer_cmd=tcmd, max_restarts=max_restarts, ready_timeout_s=ready_timeout,
            log_dir=log_dir, engines=engines, say=sup_say,
        )  # fmt: skip
    except _up.UpError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    raise typer.Exit(_up.Supervisor(cfg, say=sup_say).run())


from hsstream.train_cli import DraftOptionsCommand, submit_source, train  # noqa: E402  (typer only at import)

app.command(cls=DraftOptionsCommand)(train)
__all__ = ["app", "main", "submit_source"]


@app.command("eval")
def eval_(
    draft: str = typer.Option(..., help="the draft dir in speculators' format (a run's OUT/final, or a checkpoint's draft/): "
                                        "Eagle-3, P-EAGLE or DFlash"),
    model: str = typer.Option(None, "--model", help="verifier checkpoint dir or short name, e.g. smollm2 (default: the "
                                                    "one the draft's config names, if it is a directory here, else HSSTREAM_MODEL)"),
    prompts: str = typer.Option(None, help="plain text, one prompt a line; or samples as `hsstream submit` reads them "
                                          "(JSONL, a JSON array, parquet, a dataset...: prompt, chat or token_ids rows; "
                                          "a chat row prompts with its conversation up to the first reply) "
                                          "(default: the 32 prompts bench/served_acceptance/acceptance.py measures on)"),
    preset: str = typer.Option(None, help="with --prompts: the rows' layout, sharegpt | ultrachat | openai"),
    field: list[str] = typer.Option(None, "--field", help="with --prompts: NAME=COLUMN (repeatable), as `hsstream submit --field`"),
    data_split: str = typer.Option(None, "--split", help="with --prompts: the datasets split"),
    rows: str = typer.Option(None, help="with --prompts: only the source's rows START:STOP (0-based, STOP excluded), "
                                       "e.g. the rows a run did not train on"),
    row_hashes: str = typer.Option(None, help="with --prompts: only the rows whose digest (sha256 of the row's "
                                             "canonical JSON, trainer_client.data_sources.row_digest) is in FILE"),
    chat_template_kwargs: str = typer.Option(None, help="with --prompts: the chat template's variables (JSON)"),
    job: str = typer.Option(None, help="or prompt with this job's held-out samples (the sidecar's; with --eval-fraction)"),
    eval_fraction: float = typer.Option(0.0, min=0.0, help="with --job: the share `hsstream train "
                                        "--eval-fraction` held out (same rule, same seed)"),
    eval_seed: int = typer.Option(0, help="with --job: the seed the run trained with (--eval-seed)"),
    max_prompts: int = typer.Option(32, min=1, help="with --job or a --prompts source of samples: at most this many prompts"),
    api: str = typer.Option(None, help="with --job: sidecar REST URL (default http://HSSTREAM_HOST:HSSTREAM_PORT)"),
    num_speculative_tokens: int = typer.Option(None, min=1, help="draft tokens a step (default: the draft's: Eagle-3 "
                                                           "its TTT steps, P-EAGLE its parallel tokens, DFlash "
                                                           "block_size - 1)"),
    max_tokens: int = typer.Option(64, min=1, help="tokens generated per prompt (exactly: EOS ignored)"),
    temperature: list[float] = typer.Option(None, help="sampling temperature (repeatable; default 0)"),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="also serve without the draft, for tokens/s"),
    max_model_len: int = typer.Option(1024, help="vLLM's context length"),
    dtype: str = typer.Option("auto", help="vLLM's --dtype for the verifier: auto (the checkpoint's), bfloat16, float32 "
                                           "(on a CPU without native bf16, float32 serves several times faster)"),
    workdir: str = typer.Option(None, help="keep the engines' logs here (default: a temp dir)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON instead of a table"),
) -> None:
    """Serve the verifier with a draft in vLLM and measure acceptance.

    Per position, the mean acceptance length (tokens per verifier step) and tokens/s with and
    without the draft; ours from the requests' records beside vLLM's own counters."""
    import json
    import tempfile
    from pathlib import Path

    from connector.contract.settings import Settings
    from hsstream import evaluate as E

    s = Settings()
    mdl = _model_path(model or E.draft_verifier(draft) or s.model)
    if not mdl:
        typer.echo("error: no model: pass --model or set HSSTREAM_MODEL (the draft's config names no verifier here)", err=True)
        raise typer.Exit(2)
    if job and prompts:
        typer.echo("error: give --prompts or --job, not both", err=True)
        raise typer.Exit(2)
    split = None
    try:
        E.check_draft_dir(draft)
        if job:
            from connector.contract.api_token import client_token
            from connector.contract.rest_client import SidecarClient, SidecarError

            try:
                with SidecarClient(api or f"http://{s.host}:{s.port}", token=client_token(s.api_token, s.run_dir)) as client:
                    plist, split = E.job_prompts(client, job, eval_fraction, eval_seed, limit=max_prompts,
                                                 max_prompt_tokens=max(1, max_model_len - max_tokens))  # fmt: skip
            except SidecarError as e:
                raise ValueError(str(e)) from e
        elif prompts and not E.is_plain_text(prompts) or preset or field or data_split or rows or row_hashes:
            if not prompts:
                raise ValueError("--preset, --field, --split, --rows and --row-hashes go with --prompts SOURCE")
            from hsstream.job_options import parse_kwargs

            plist, split = E.source_prompts(prompts, mdl, preset=preset, fields=field, split=data_split, rows=rows,
                                            row_hashes=row_hashes, limit=max_prompts,
                                            max_prompt_tokens=max(1, max_model_len - max_tokens),
                                            chat_template_kwargs=parse_kwargs(chat_template_kwargs))  # fmt: skip
            for note in split["notes"]:
                typer.echo(f"note: {note}", err=True)
            if split["skipped"]:
                why = ", ".join(f"{k} {n}" for k, n in split["skipped"].items())
                typer.echo(f"note: rows that give no prompt, skipped: {why}", err=True)
        elif prompts:
            plist = E.read_prompts(prompts)
        else:
            from hsstream.pretrain_verifier import held_out_prompts

            plist = held_out_prompts(32)
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    wd = Path(workdir or tempfile.mkdtemp(prefix="hsstream-eval-"))
    wd.mkdir(parents=True, exist_ok=True)
    try:
        res = E.evaluate(mdl, draft, plist, max_tokens=max_tokens, temps=list(temperature or [0.0]),
                         spec_tokens=num_speculative_tokens, baseline=baseline, workdir=wd, max_model_len=max_model_len,
                         dtype=dtype)  # fmt: skip
    except RuntimeError as e:
        typer.echo(f"error: {e}\n(logs in {wd})", err=True)
        raise typer.Exit(1) from e
    res["workdir"] = str(wd)
    if split is not None:
        res["held_out" if job else "prompts_from"] = split
    if as_json:
        typer.echo(json.dumps(res, indent=2))
    else:
        E.print_table(res)


@app.command()
def keys(directory: str = typer.Argument(..., help="where to write the key pair"), name: str = typer.Option("trainer", help="file name stem")) -> None:
    """Make a CURVE key pair for remote delivery.

    NAME.key is the public key, NAME.key_secret the secret one (0600, in a 0700 folder).

    The sidecar's pair goes to HSSTREAM_CURVE_SERVER_SECRET_FILE; each trainer's public
    NAME.key goes into the sidecar's HSSTREAM_CURVE_CLIENTS_DIR."""
    from connector.contract.curve_keys import InsecureKeyFile, write_key_pair

    try:
        pub, sec = write_key_pair(directory, name)
    except InsecureKeyFile as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(f"public: {pub}\nsecret: {sec} (mode 0600: keep it on this host)")


from hsstream.proxy.cli import app as _proxy_app  # noqa: E402  (typer only: its commands import lazily)

app.add_typer(_proxy_app, name="proxy")


def main() -> None:
    from connector.contract.endpoints import InsecureEndpoint

    try:
        app(prog_name="hsstream")
    except InsecureEndpoint as e:  # a plain tcp:// notice or delivery endpoint, from any command's settings
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
