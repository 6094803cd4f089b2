"""``hsstream train``: its flags (one per draft setting too, from each draft's options:
``DraftOptionsCommand``), the config file they override, and the run. Registered on the
``hsstream`` app by ``cli.py``; typer only at import, the trainer imported when it runs."""

from __future__ import annotations

import os
import sys

import typer

from hsstream.assets_cli import model_path as _model_path
from hsstream.cli_text import (H_KWARGS, H_MAX_NEW, H_MAX_TOKENS, H_MODE, H_ON_INVALID, H_OVERLONG, H_SAMPLING_SEED,
                               H_TEMPERATURE, H_TOP_P)


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


def train(
    ctx: typer.Context,
    config: str = typer.Option(None, help="YAML or TOML file of settings (keys: docs/trainer.md); flags override it"),
    dump_config: bool = typer.Option(False, "--dump-config", help="print the resolved settings as a --config file and exit"),
    model: str = typer.Option(None, "--model", "--verifier-name-or-path",
                              help="verifier checkpoint dir or short name, e.g. smollm2 (default HSSTREAM_MODEL)"),
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
    if not dump_config:  # the file keeps the short name, as written
        cfg.verifier = _model_path(cfg.verifier)
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
