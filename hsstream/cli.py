"""``hsstream``: one entry point for every role; heavy imports happen inside each command."""

from __future__ import annotations

import os
import sys

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="Hidden-state streaming for online Eagle-3 training.")


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
    from connector import protocol as P
    from connector.contract.arena import ArenaError
    from connector.contract.curve_keys import InsecureKeyFile
    from connector.contract.settings import Settings
    from hsstream import launch
    from hsstream.exposure import OpenBindRefused, check_api_exposure

    s = Settings()
    bind = host or s.host
    try:
        warning = check_api_exposure(bind, s.api_token, s.allow_open or insecure_no_token)
    except OpenBindRefused as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if warning:
        typer.echo(warning, err=True)
    # uvicorn stops gracefully on SIGTERM, then re-raises it to the handler it found, to die by
    # it (exit 143) although the stop was clean: this handler makes that exit status 0.
    launch.exit_0_on_stop()
    try:
        app_ = create_app(s)
    except (P.SpoolNotOurs, InsecureKeyFile, ArenaError) as e:  # ArenaError: a tmpfs too small for it
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    # Slow, idle and surplus connections are closed (server/connections.py).
    http = protocol_class(s.http_header_timeout_s, connection_limit(s))
    uvicorn.run(app_, host=bind, port=port or s.port, log_level="warning", http=http,
                timeout_keep_alive=s.http_idle_timeout_s)  # fmt: skip


@app.command()
def vllm(
    model: str = typer.Option(None, help="verifier checkpoint (default HSSTREAM_MODEL)"),
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
    from connector.layers import LayerIdError
    from connector.contract.settings import Settings
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
def demo(prompts: int = typer.Option(32, help="number of samples to stream"), workdir: str = typer.Option(None, help="keep files here (default: a temp dir)")) -> None:
    """Stream samples from the tiny model on CPU, end to end.

    vLLM → spool → sidecar → HiddenStateStream, with a summary."""
    from hsstream.demo import run_demo

    raise typer.Exit(run_demo(prompts, workdir))


#: The job-option flags of `submit` and `train` (hsstream/job_options.py), one help text each.
H_ON_INVALID = "skip (default) | reject: a row no trainer can use is skipped and counted per reason, or refuses the job"
H_MAX_TOKENS = "cap on a sample's tokens (see --overlong)"
H_OVERLONG = "truncate | reject (default): what a sample over the cap becomes"
H_KWARGS = 'the chat template\'s variables as JSON, as vLLM\'s chat_template_kwargs, e.g. \'{"enable_thinking": false}\''
H_MODE = "extract (default: train on the data's replies) | regenerate (vLLM writes new replies: speculators' and EAGLE-3's recipe)"
H_TEMPERATURE = "--mode regenerate: sampling temperature of the new replies (default 0)"
H_TOP_P = "--mode regenerate: top-p of the new replies (default 1)"
H_MAX_NEW = "--mode regenerate: tokens a new reply may have (default 256)"
H_SAMPLING_SEED = "--mode regenerate: seed of the replies (each epoch gets its own, derived from it)"


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
    model: str = typer.Option(None, help="verifier checkpoint dir (default HSSTREAM_MODEL or MODEL_DIR, else the tiny model)"),
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


class DraftOptionsCommand(typer.core.TyperCommand):
    """``hsstream train``: beside its own options, every registered draft's settings as flags,
    derived from the drafts' plug-ins (``Draft.Options``, trainer_client/drafts/options.py) and
    put after ``--draft``. Built when the command is parsed or its help shown, not for every
    ``hsstream`` command: the plug-ins come with torch. Their values reach the command through
    ``ctx.params``, as every other setting does."""

    def __init__(self, *args, callback=None, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        self._own: list = []
        self._all: list | None = None  # one list object: click appends to it and pops (its help option)
        self._drafts: list | None = None
        inner = callback

        def call(**values):  # noqa: ANN003, ANN202 - typer's callback knows only the command's own
            names = {p.name for p in self._draft_params()}
            return inner(**{k: v for k, v in values.items() if k not in names})

        super().__init__(*args, callback=call if inner is not None else None, **kwargs)

    @property
    def params(self) -> list:  # type: ignore[override]
        if self._all is None:
            own = self._own
            at = next((i + 1 for i, p in enumerate(own) if p.name == "draft"), len(own))
            self._all = [*own[:at], *self._draft_params(), *own[at:]]
        return self._all

    @params.setter
    def params(self, value: list) -> None:
        self._own, self._all = list(value or []), None

    def _draft_params(self) -> list:
        if self._drafts is None:
            self._drafts = draft_option_params()
        return self._drafts


def draft_option_params() -> list:
    """One flag per draft setting (several drafts may share one), typed and bounded, its help
    naming the drafts that take it and their defaults; None unless given (the draft's default)."""
    import inspect

    from trainer_client import drafts

    params, hints = [], {}
    for name, owners in drafts.option_table().items():
        spec = owners[0][1]
        groups: dict[tuple, list[str]] = {}
        for d, s in owners:
            groups.setdefault((s.help, s.default), []).append(d)
        parts = []
        for (text, default), ds in groups.items():
            shown = "" if default is None or default is False else f" (default {default})"
            parts.append(f"{', '.join(ds)}: {text}{shown}")
        tp = spec.base_type
        decls = [f"{spec.all_flags[0]}/--no-{spec.all_flags[0][2:]}"] if tp is bool else list(spec.all_flags)
        mins = {s.min for _, s in owners}
        bound = {"min": mins.pop()} if len(mins) == 1 and tp in (int, float) and None not in mins else {}
        opt = typer.Option(None, *decls, help="; ".join(parts), show_default=False, **bound)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=tp | None))
        hints[name] = tp | None

    def settings(**values):  # noqa: ANN003, ANN202 - never called: typer reads its signature
        return values

    settings.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    settings.__annotations__ = hints
    holder = typer.Typer(add_completion=False)
    holder.command()(settings)
    return list(typer.main.get_command(holder).params)


@app.command(cls=DraftOptionsCommand)
def train(
    ctx: typer.Context,
    config: str = typer.Option(None, help="YAML or TOML file of settings (keys: docs/trainer.md); flags override it"),
    dump_config: bool = typer.Option(False, "--dump-config", help="print the resolved settings as a --config file and exit"),
    model: str = typer.Option(None, "--model", "--verifier-name-or-path", help="verifier checkpoint dir (default HSSTREAM_MODEL)"),
    out: str = typer.Option(None, "--out", "--save-path", help="run dir: checkpoints/, final/, metrics.jsonl; resumed if it exists"),
    job: list[str] = typer.Option(None, help="job id to follow (repeatable)"),
    submit: str = typer.Option(None, help="samples to submit as one job: a file or dataset, as `hsstream submit` takes"),
    submit_preset: str = typer.Option(None, help="with --submit: the rows' layout, sharegpt | ultrachat | openai"),
    submit_field: list[str] = typer.Option(None, help="with --submit: NAME=COLUMN (repeatable), as `hsstream submit --field`"),
    submit_split: str = typer.Option(None, help="with --submit: the datasets split"),
    submit_limit: int = typer.Option(None, min=0, help="with --submit: at most N samples"),
    submit_shuffle: bool = typer.Option(False, "--submit-shuffle", help="with --submit: buffer shuffle (10,000 rows), --seed"),
    epochs: int = typer.Option(1, help="with --submit: how many times the sidecar streams each sample"),
    loss_mask: str = typer.Option("assistant", help="with --submit: 'assistant' or 'all'"),
    on_invalid: str = typer.Option(None, help="with --submit: " + H_ON_INVALID),
    max_tokens_per_sample: int = typer.Option(None, min=1, help="with --submit: " + H_MAX_TOKENS),
    overlong: str = typer.Option(None, help="with --submit: " + H_OVERLONG),
    chat_template_kwargs: str = typer.Option(None, help="with --submit: " + H_KWARGS),
    mode: str = typer.Option(None, help="with --submit: " + H_MODE),
    temperature: float = typer.Option(None, help=H_TEMPERATURE),
    top_p: float = typer.Option(None, help=H_TOP_P),
    max_new_tokens: int = typer.Option(None, help=H_MAX_NEW),
    sampling_seed: int = typer.Option(None, help=H_SAMPLING_SEED),
    api: str = typer.Option(None, help="sidecar REST URL (default http://HSSTREAM_HOST:HSSTREAM_PORT)"),
    endpoint: str = typer.Option(None, help="delivery endpoint (default HSSTREAM_DELIVERY_ENDPOINT)"),
    spool: str = typer.Option(None, help="spool dir (default HSSTREAM_SPOOL_DIR)"),
    token_counts: str = typer.Option(None, help="token counts file (JSON id->count) for the draft vocabulary"),
    draft: str = typer.Option("eagle3", "--draft", "--speculator-type", help="the draft to train: eagle3, peagle, dflash or dspark"),
    # each draft's own settings follow here (DraftOptionsCommand: from the drafts' plug-ins)
    draft_vocab_size: int = typer.Option(None, help="draft vocabulary size (default min(32000, verifier's))"),
    aux_layers: str = typer.Option(None, "--aux-layers", "--target-layer-ids",
                                   help="aux layer ids, comma-separated (default 2, N//2, N-3; Eagle-3 and P-EAGLE take three)"),
    steps: int = typer.Option(None, "--steps", "--max-steps", help="stop after this many steps (default: when the jobs are complete)"),
    samples_per_step: int = typer.Option(1, help="samples per optimiser step"),
    max_tokens_per_step: int = typer.Option(4096, "--max-tokens-per-step", "--total-seq-len",
                                            help="a step takes no more samples once it holds this many tokens"),
    lr: float = typer.Option(1e-3, help="peak learning rate"),
    min_lr_ratio: float = typer.Option(0.1, help="the LR decays to this share of --lr"),
    warmup: int = typer.Option(20, "--warmup", "--scheduler-warmup-steps", help="linear warm-up steps"),
    schedule: str = typer.Option("cosine", "--schedule", "--scheduler-type",
                                 help="LR after warm-up: cosine | linear (decay to --min-lr-ratio) | constant"),
    schedule_steps: int = typer.Option(None, "--schedule-steps", "--scheduler-total-steps",
                                       help="length of the LR decay (default --steps, else the jobs' samples × epochs / samples a step)"),
    weight_decay: float = typer.Option(0.0, help="AdamW weight decay"),
    betas: str = typer.Option(None, help="AdamW betas, comma-separated (default 0.9,0.95)"),
    grad_clip: float = typer.Option(1.0, help="gradient norm clip"),
    checkpoint_every: int = typer.Option(100, help="steps between checkpoints"),
    checkpoint_every_s: float = typer.Option(None, help="also checkpoint every this many seconds of wall-clock"),
    keep_checkpoints: int = typer.Option(2, help="checkpoints kept (0: all); final/ is never removed"),
    eval_every: int = typer.Option(0, help="every N steps, top-1 per TTT step on samples held out (0: never)"),
    eval_samples: int = typer.Option(8, help="with --eval-every: the first K samples of the stream are held out"),
    eval_ids: str = typer.Option(None, help="with --eval-every: hold out these sample ids instead (comma-separated)"),
    eval_fraction: float = typer.Option(0.0, min=0.0, help="hold out this share of every job (by sample id or "
                                        "index and --eval-seed), never trained; `hsstream eval --job` takes the same"),
    eval_seed: int = typer.Option(0, help="with --eval-fraction: the seed of the split"),
    log_every: int = typer.Option(10, "--log-every", "--log-freq", help="steps between lines in metrics.jsonl and the log"),
    threads: int = typer.Option(1, help="torch CPU threads (1 is fastest beside vLLM on a small machine)"),
    timeout: float = typer.Option(600.0, help="seconds without a sample before giving up"),
    idle_s: float = typer.Option(0.2, help="seconds without a sample before the loop checkpoints a job's tail"),
    seed: int = typer.Option(0, help="random seed"),
    control: str = typer.Option("none", help="'swap-hidden': negative control, aux states from another sample"),
    progress: bool = typer.Option(True, help="progress bar on stderr"),
    device: str = typer.Option("auto", help="auto (cuda if available), cpu, cuda or cuda:N; under torchrun cuda:LOCAL_RANK"),
    autocast: str = typer.Option("auto", help="auto (bf16 on CUDA, none on CPU), bf16 or none"),
    prefetch: int = typer.Option(None, help="batches copied to the device ahead of the step (default 1 on CUDA, 0 on CPU)"),
    logger: str = typer.Option(None, help="tensorboard, wandb (comma-separated) or none; default: tensorboard if installed"),
    nproc: int = typer.Option(1, min=1, help="trainer ranks on this host (runs itself under torchrun; gloo on CPU, NCCL on GPUs)"),
    follow: bool = typer.Option(False, "--follow", help="train on every job of the sidecar as it comes, with no end "
                                "(live traffic from `hsstream proxy`); the LR stays constant after warm-up"),
    init_draft: str = typer.Option(None, help="warm start: a trained draft dir (the serving one) whose weights, "
                                   "layers and vocabulary the run starts from"),
    mix: str = typer.Option(None, help="with --follow: a file or dataset (as --submit takes) kept at --mix-share "
                            "of what is trained, against forgetting"),
    mix_share: float = typer.Option(0.2, min=0.0, max=0.95, help="with --mix: the original data's share of the stream"),
) -> None:
    """Train a draft (Eagle-3, P-EAGLE, DFlash, DSpark) on the stream.

    Speculators' format; checkpoints, resumes from --out, ends with OUT/final and the
    `vllm serve` line. Settings from --config FILE, flags winning."""
    from hsstream import train_config as TC

    def given(name: str) -> bool:
        src = ctx.get_parameter_source(name)
        return src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP")

    if config and not given("nproc") and "WORLD_SIZE" not in os.environ:
        try:  # read before torch loads: the file may ask for several ranks
            nproc = int(TC.load_mapping(config).get("nproc", nproc) or 1)
        except (TC.ConfigFileError, ValueError, TypeError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e
    if nproc > 1 and "WORLD_SIZE" not in os.environ and not dump_config:
        from trainer_client.train.distributed import torchrun_argv

        args = torchrun_argv(nproc, sys.argv[1:])
        typer.echo(f"hsstream train: {nproc} ranks: {' '.join(args[:6])} ...", err=True)
        os.execv(args[0], args)  # torchrun's agent takes over: it stops every rank when one fails
    from hsstream.launch import exit_0_on_stop

    exit_0_on_stop()  # first, before torch loads: a stop asked for (up's Ctrl-C) is a clean exit
    import json
    import logging

    from connector.contract.settings import Settings

    s = Settings()
    try:
        layers = ({}, TC.read(config) if config else {}, {})  # default, file, flag
        for name, value in ctx.params.items():
            if name in ("config", "dump_config") or value is None or (name in ("job", "submit_field") and not value):
                continue
            key = TC.canonical(name)
            assert key is not None, f"--{name} names no setting"
            layers[2 if given(name) else 0][key] = TC.coerce(key, value, where="--" + name.replace("_", "-"))
        if s.model:
            layers[0].setdefault("verifier", s.model)
        cfg, run = TC.merge(*layers)
    except TC.ConfigFileError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if dump_config:
        typer.echo(TC.dump(cfg, run), nl=False)
        return
    from connector.contract.holdout import check_fraction

    from hsstream import job_options as JO

    try:  # before any sidecar is asked (the trainer refuses it beside --eval-ids)
        check_fraction(cfg.eval_fraction)
        job_options = JO.build({"loss_mask": run.get("loss_mask", "assistant")}, **{k: run.get(k) for k in JO.FLAGS})
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    cfg.extra = {**cfg.extra, "argv": sys.argv, **({"config": os.path.abspath(config)} if config else {})}

    from trainer_client.drafts.base import MissingLayersError
    from trainer_client.train.config import DeviceError
    from trainer_client.train.run import run_train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        result = run_train(
            cfg, api=run.get("api") or f"http://{s.host}:{s.port}", endpoint=run.get("endpoint") or s.delivery_ep(),
            spool_dir=run.get("spool") or str(s.spool_dir), jobs=run.get("jobs") or None, submit_file=run.get("submit"),
            epochs=run.get("epochs", 1), job_options=job_options,
            token_counts_file=run.get("token_counts"), api_token=s.api_token, timeout_s=run.get("timeout", 600.0),
            submit_source=submit_source(run, cfg.seed), follow=bool(run.get("follow")),
            mix={"file": run["mix"], "share": run.get("mix_share", 0.2)} if run.get("mix") else None,
        )  # fmt: skip
    except (MissingLayersError, DeviceError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if int(os.environ.get("RANK", "0")) == 0:  # one summary per run (it lists every rank)
        typer.echo(json.dumps(result.summary(), indent=2))
        if result.serve:  # stdout stays one JSON document; the line to copy goes to the terminal
            typer.echo(f"serve the trained draft ({result.final_dir}) with:\n  {result.serve}", err=True)
        elif result.serve_refused:  # the draft's plug-in: the installed vLLM would refuse it
            typer.echo(f"the trained draft is in {result.final_dir}, but {result.serve_refused}", err=True)


def submit_source(run: dict, seed: int) -> dict:
    """``hsstream train --submit-*`` as :func:`trainer_client.data_sources.iter_samples`' arguments."""
    src: dict = {"preset": run.get("submit_preset"), "fields": run.get("submit_field") or None,
                 "split": run.get("submit_split"), "limit": run.get("submit_limit")}  # fmt: skip
    if run.get("submit_shuffle"):
        src.update(shuffle=True, seed=seed)
    return {k: v for k, v in src.items() if v is not None}


@app.command("eval")
def eval_(
    draft: str = typer.Option(..., help="the draft dir in speculators' format (a run's OUT/final, or a checkpoint's draft/): "
                                        "Eagle-3, P-EAGLE or DFlash"),
    model: str = typer.Option(None, "--model", help="verifier checkpoint (default: the one the draft's config names, "
                                                    "if it is a directory here, else HSSTREAM_MODEL)"),
    prompts: str = typer.Option(None, help="plain text, one prompt a line; or samples as `hsstream submit` reads them "
                                          "(JSONL, a JSON array, parquet, a dataset...: prompt, chat or token_ids rows; "
                                          "a chat row prompts with its conversation up to the first reply) "
                                          "(default: the 32 prompts bench/acceptance.py measures on)"),
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
    mdl = model or E.draft_verifier(draft) or s.model
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
            from connector.contract.rest_client import SidecarClient, SidecarError

            try:
                with SidecarClient(api or f"http://{s.host}:{s.port}", token=s.api_token) as client:
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
                         spec_tokens=num_speculative_tokens, baseline=baseline, workdir=wd, max_model_len=max_model_len)  # fmt: skip
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
