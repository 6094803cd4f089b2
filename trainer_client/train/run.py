"""``hsstream train``: submit (or follow) jobs, train a draft on their stream, resume after a crash.

The job ids a run follows are written to ``OUT/jobs.json`` before anything is streamed, so a
restarted run follows the same jobs instead of submitting them again; what it has already
trained is in its newest checkpoint and the sidecar re-delivers the rest.

Under torchrun (``WORLD_SIZE`` > 1) rank 0 resolves the jobs and token counts (submitting at
most once) and hands them to the other ranks; every rank then opens its own stream.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from connector.contract.rest_client import SidecarClient, SidecarError
from trainer_client.train import vocab as V
from trainer_client.train.config import resolve_device
from trainer_client.train.distributed import World
from trainer_client.train.trainer import OnlineTrainer, TrainConfig, TrainResult

log = logging.getLogger("hsstream.train")

JOBS_FILE = "jobs.json"
COUNTS_FILE = "token_counts.json"
#: ``--follow``: an open-ended stream waits for traffic however long it is quiet.
FOLLOW_TIMEOUT_S = 10.0**9


def read_samples(path: str | Path, **source: Any) -> Iterator[dict]:
    """REST samples (``prompt`` / ``messages`` / ``conversations`` / ``token_ids``) from a file or
    dataset, lazily: JSONL (``.jsonl.gz`` too), a JSON array, parquet, arrow/feather, a
    ``datasets`` folder or name (``trainer_client/data_sources.py``; ``source``: ``preset``, ``fields``,
    ``split``, ``limit``, ``shuffle``, ``seed``). The source is checked now, its rows read as
    iterated; ValueError when it cannot be read."""
    from trainer_client import data_sources as DS

    try:
        rows = DS.iter_samples(path, **source)
    except DS.DataSourceError as e:
        raise ValueError(str(e)) from e

    def checked() -> Iterator[dict]:
        n = 0
        try:
            for r in rows:
                n += 1
                yield r
        except DS.DataSourceError as e:
            raise ValueError(str(e)) from e
        if not n:
            raise ValueError(f"{path}: no samples")

    return checked()


def submit_job(api: str, samples: Iterable[dict], options: dict | None = None, token: str | None = None,
               filename: str = "samples.jsonl") -> str:  # fmt: skip
    """One job, uploaded as JSONL made on the fly (``hsstream submit``'s path: the samples are
    never held together); ``options.epochs`` makes the sidecar stream every sample once per
    epoch (new keys)."""
    with SidecarClient(api, token=token, timeout=600) as c:
        try:
            return c.upload(samples, options or {}, filename=filename).job_id
        except SidecarError as e:
            raise RuntimeError(f"the sidecar refused the job: {str(e)[:500]}") from e
        except Exception as e:  # the source broke while it was read (the client took back what got queued)
            raise ValueError(f"{e} (nothing was queued)") from e


def drained_probe(api: str, jobs: list[str], token: str | None = None):  # noqa: ANN201
    """True once no sample of ``jobs`` is waiting to be produced or delivered.

    The sidecar ends a job only when every sample is acknowledged; a trainer deferring acks
    to checkpoints asks this after each step and checkpoints as soon as it holds the tail.
    """
    client = SidecarClient(api, token=token, timeout=10)

    def probe(_pending: int) -> bool:
        left = 0
        for j in jobs:
            try:
                c = client.job(j).counts
            except SidecarError as e:
                if e.unreachable:
                    raise
                return False
            left += c.get("queued", 0) + c.get("submitted", 0) + c.get("ready", 0)
        return left == 0

    return probe


def jobs_samples_total(api: str | None, jobs: list[str], token: str | None = None) -> int | None:
    """How many samples the jobs deliver in all, every epoch's copy counted (a job's
    ``num_samples`` in ``GET /v1/jobs/{id}`` is the sample count times its ``options.epochs``);
    None when the sidecar cannot say."""
    if not api:
        return None
    total = 0
    with SidecarClient(api, token=token, timeout=30) as c:
        for j in jobs:
            try:
                total += c.job(j).num_samples
            except SidecarError as e:
                log.warning("job %s: its size is unknown (%s)", j, str(e)[:200])
                return None
    return total


def plan_schedule(cfg: TrainConfig, samples_total: int | None, world_size: int = 1) -> None:
    """Without ``--steps`` or ``--schedule-steps`` the run lasts until the jobs are complete, so
    the LR decay spans the steps the jobs' samples make: ``samples_total`` over the samples a
    step takes on all ranks. An estimate: steps cut short by ``max_tokens_per_step`` make the run
    longer (the LR then stays at its floor), held-out samples make it a little shorter."""
    if cfg.schedule_steps is not None or cfg.max_steps is not None or cfg.schedule == "constant":
        return
    if not samples_total:
        log.warning("the jobs' sizes are unknown and neither --steps nor --schedule-steps is given: "
                    "the LR stays constant after warm-up")  # fmt: skip
        return
    trained = samples_total * (1.0 - cfg.eval_fraction)  # ``eval_fraction``'s share is never trained
    cfg.schedule_steps = max(1, math.ceil(trained / (max(1, cfg.samples_per_step) * max(1, world_size))))
    log.info("LR schedule (%s) over %d steps: %d samples, %d a step", cfg.schedule, cfg.schedule_steps,
             samples_total, cfg.samples_per_step * max(1, world_size))  # fmt: skip


def recorded_samples_total(cfg: TrainConfig, api: str | None, jobs: list[str], token: str | None) -> int | None:
    """The jobs' total from ``OUT/jobs.json`` (a restarted run keeps its schedule, whatever the
    sidecar still knows), else asked of the sidecar and recorded there."""
    path = Path(cfg.out_dir) / JOBS_FILE
    rec = json.loads(path.read_text()) if path.exists() else {}
    if rec.get("samples_total"):
        return int(rec["samples_total"])
    total = jobs_samples_total(api, jobs, token)
    if total and path.exists():
        path.write_text(json.dumps({**rec, "samples_total": total}) + "\n")
    return total


def resolve_jobs_and_counts(
    cfg: TrainConfig,
    *,
    api: str | None,
    jobs: list[str] | None,
    submit_file: str | None,
    epochs: int,
    job_options: dict | None,
    token_counts_file: str | None,
    api_token: str | None,
    submit_source: dict | None = None,
) -> tuple[list[str], dict[int, int] | None]:
    """The jobs this run follows (submitting ``submit_file`` once) and the token counts for the
    draft vocabulary; recorded in the run dir, so a restart follows the same ones."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs_path = out / JOBS_FILE
    samples = None  # with --submit: a callable giving its samples again
    if jobs_path.exists():
        recorded = json.loads(jobs_path.read_text())["jobs"]
        if jobs and sorted(jobs) != sorted(recorded):
            raise ValueError(f"{out} belongs to a run following jobs {recorded}, not {jobs}: use another --out")
        jobs = recorded
        log.info("continuing the run in %s on jobs %s", out, jobs)
    elif submit_file:
        if not api:
            raise ValueError("--submit needs the sidecar's REST address (--api)")
        jobs = [submit_job(api, read_samples(submit_file, **(submit_source or {})),
                           {**(job_options or {}), "epochs": epochs}, api_token, filename=Path(submit_file).name)]
        samples = lambda: read_samples(submit_file, **(submit_source or {}))  # noqa: E731  (read again, for local counts)
        jobs_path.write_text(json.dumps({"jobs": jobs, "submitted_from": str(submit_file), "epochs": epochs,
                                         **({"source": submit_source} if submit_source else {})}) + "\n")  # fmt: skip
    elif jobs:
        jobs_path.write_text(json.dumps({"jobs": jobs}) + "\n")
    else:
        raise ValueError("nothing to train on: pass --job ID (repeatable) or --submit FILE")

    counts = None
    counts_path = out / COUNTS_FILE
    if counts_path.exists():
        counts = V.token_counts_from_file(counts_path)
    elif token_counts_file:
        counts = V.token_counts_from_file(token_counts_file)
    else:
        if api:
            counts = V.token_counts_from_sidecar(api, jobs, api_token)
        # None: no such endpoint; empty: nothing masked yet (a regenerate job: vLLM writes the
        # replies while it trains): then the data's own replies, tokenised here, stand in
        if not counts and samples is not None:
            if counts is not None:
                log.info("the sidecar counts no trained token yet (regenerate mode?): the draft vocabulary comes "
                         "from the data's own replies")  # fmt: skip
            opts = job_options or {}
            job = {k: opts[k] for k in ("chat_template", "chat_template_kwargs") if opts.get(k) is not None}
            counts = V.token_counts_from_samples(cfg.verifier, samples(), opts.get("loss_mask", "assistant"), **job)
    if counts is not None:
        V.save_token_counts(counts, counts_path)
    return jobs, counts


def follow_setup(cfg: TrainConfig, *, jobs: list[str] | None, submit_file: str | None,
                 token_counts_file: str | None) -> dict[int, int] | None:  # fmt: skip
    """``--follow``: train on every job of the sidecar as it comes (the proxy's traffic jobs, and
    the ``--mix`` share), with no end. Nothing to submit and no total: the LR stays constant
    after its warm-up (a decay needs a horizon an open stream has not), and the draft's
    vocabulary comes from ``--init-draft`` or ``--token-counts`` (the jobs it will see are not
    there yet). Recorded in ``OUT/jobs.json``."""
    if jobs or submit_file:
        raise ValueError("--follow trains on every job of the sidecar as it comes: not with --job or --submit")
    if cfg.schedule != "constant" and cfg.schedule_steps is None and cfg.max_steps is None:
        log.info("--follow: an open-ended stream, the LR stays constant after %d warm-up steps", cfg.warmup_steps)
        cfg.schedule = "constant"
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / JOBS_FILE).write_text(json.dumps({"jobs": None, "follow": True}) + "\n")
    counts_path = out / COUNTS_FILE
    if counts_path.exists():
        return V.token_counts_from_file(counts_path)
    if token_counts_file:
        counts = V.token_counts_from_file(token_counts_file)
        V.save_token_counts(counts, counts_path)
        return counts
    return None


def run_train(
    cfg: TrainConfig,
    *,
    api: str | None,
    endpoint: str | None,
    spool_dir: str | None,
    jobs: list[str] | None = None,
    submit_file: str | None = None,
    epochs: int = 1,
    job_options: dict | None = None,
    token_counts_file: str | None = None,
    api_token: str | None = None,
    timeout_s: float = 600.0,
    credit: int = 8,
    submit_source: dict | None = None,
    follow: bool = False,
    mix: dict | None = None,
) -> TrainResult:
    """Train a draft on the stream. ``follow``: on every job as it comes, with no end
    (:func:`follow_setup`); ``mix``: ``{"file", "share", **source options}``, a share of an
    original dataset kept beside the traffic (``mixing.py``)."""
    from trainer_client.train.loggers import names as logger_names
    from trainer_client.stream import HiddenStateStream

    logger_names(cfg.logger, tensorboard=cfg.tensorboard)  # a logger asked for but missing: before any job is submitted
    from trainer_client import drafts as D
    from trainer_client.train.checkpoints import verifier_text_config

    kind = D.get(cfg.draft)  # an unknown draft, or one missing its mask token: also before any job is submitted
    draft = None
    if kind.needs_mask_token:
        try:
            draft = kind(cfg, verifier_text_config(cfg.verifier))
        except OSError as e:
            raise ValueError(f"--model {cfg.verifier}: no verifier config ({e.strerror or e})") from e
    n = World.env_size()
    world = World.from_env(resolve_device(cfg.device, local_rank=World.env_local_rank(), world_size=n))
    try:
        if world.is_writer:
            try:
                if follow:
                    jobs, total = None, None
                    counts = follow_setup(cfg, jobs=jobs, submit_file=submit_file, token_counts_file=token_counts_file)
                else:
                    jobs, counts = resolve_jobs_and_counts(
                        cfg, api=api, jobs=jobs, submit_file=submit_file, epochs=epochs, job_options=job_options,
                        token_counts_file=token_counts_file, api_token=api_token, submit_source=submit_source,
                    )  # fmt: skip
                    total = recorded_samples_total(cfg, api, jobs, api_token)
                got: object = {"jobs": jobs, "counts": counts, "samples_total": total}
            except (ValueError, RuntimeError, OSError, SidecarError) as e:
                world.broadcast(("error", f"{type(e).__name__}: {e}"))  # the other ranks stop with it
                raise
            world.broadcast(got)
        else:
            got = world.broadcast(None)
            if isinstance(got, tuple):
                raise ValueError(f"rank 0 could not start the run: {got[1]}")
        jobs, counts = got["jobs"], got["counts"]  # type: ignore[index]
        if not follow:
            plan_schedule(cfg, got["samples_total"], world.size)  # type: ignore[index]
        cfg.extra = {**cfg.extra, "jobs": jobs, **({"follow": True} if follow else {})}
        probe = drained_probe(api, jobs, api_token) if api and world.is_writer and not follow else None
        trainer = OnlineTrainer(cfg, counts, drained=probe, world=world, draft=draft)
        trainer.prepare()  # before the stream: slow, and a silent stream would lose its leases
        mixer = None
        if mix and world.is_writer:
            mixer = start_mixer(cfg, api, api_token, mix)
        try:
            with HiddenStateStream(endpoint, jobs=jobs, spool_dir=spool_dir, ack="manual", follow=follow,
                                   timeout_s=FOLLOW_TIMEOUT_S if follow else timeout_s, credit=credit,
                                   **trainer.stream_options()) as s:  # fmt: skip
                result = trainer.train(s)
        finally:
            if mixer is not None:
                mixer.stop()
        if world.is_writer:
            (Path(cfg.out_dir) / "result.json").write_text(json.dumps(result.summary(), indent=2) + "\n")
        return result
    finally:
        world.close()


def start_mixer(cfg: TrainConfig, api: str | None, token: str | None, mix: dict):  # noqa: ANN201
    """The ``--mix`` thread (``mixing.py``), started; its rows read from the file as needed."""
    from trainer_client.train.mixing import Mixer

    if not api:
        raise ValueError("--mix needs the sidecar's REST address (--api)")
    mix = dict(mix)
    path, share = mix.pop("file"), float(mix.pop("share"))
    read_samples(path, **mix)  # checked now: a bad file is an error before training, not a log line later

    def rows(n_pass: int) -> Iterator[dict]:
        return read_samples(path, **{**mix, "shuffle": True, "seed": cfg.seed + n_pass})

    m = Mixer(lambda: SidecarClient(api, token=token, timeout=60), rows, share, cfg.out_dir)
    m.start()
    return m
