"""Online draft training from a :class:`~trainer_client.HiddenStateStream`, for any draft.

Each step takes fresh samples from the stream (never stored, never revisited), has the draft
plug-in (``trainer_client/drafts/``, chosen by ``TrainConfig.draft``) pack them into one row,
and runs its forward: the loss and the per-position top-1 come from the plug-in, whose targets
are the frozen verifier's distribution at layer N. This module knows no algorithm.

This module is the loop; its pieces live beside it, as in speculators' trainer/checkpointer
split: the data path (``data_path.py``: fetch, prefetch, host→device), the step (``step.py``),
the checkpoint-and-ack policy (``checkpointing.py``), the ranks (``distributed.py``) and the
settings with the device (``config.py``).

One iteration: take the next batch (prefetched or fetched now); agree with the other ranks on
what this step holds (one small all-reduce; alone, nothing); queue the step on the device;
while it runs, fetch and copy the next batch; wait for the step; checkpoint and acknowledge
when due. A rank without a batch joins the step with a zero gradient; the loop ends when every
rank's stream has ended (or at ``max_steps``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

import torch

from connector.contract.holdout import check_fraction, held_out, sample_identity
from trainer_client import drafts as D
from trainer_client.drafts.base import Draft, Features
from trainer_client.train import checkpoints as M
from trainer_client.train import loggers as L
from trainer_client.train.checkpointing import CKPT_LOG, CheckpointPolicy, append_line
from trainer_client.train.config import TrainConfig, TrainResult, resolve_autocast, resolve_device
from trainer_client.train.data_path import BatchSource, DeviceCopier, Prefetcher, device_ops
from trainer_client.train.distributed import World
from trainer_client.stream import Sample
from trainer_client.train.step import DraftStep, lr_lambda
from trainer_client.train.stop import GracefulStop, StopWhileWaiting

log = logging.getLogger("hsstream.train")

RUN_FILE = "run.json"
VOCAB_FILE = "vocab_maps.pt"
KEYS_LOG = "trained_keys.jsonl"
METRICS_LOG = "metrics.jsonl"

__all__ = ["CKPT_LOG", "KEYS_LOG", "METRICS_LOG", "OnlineTrainer", "TrainConfig", "TrainResult", "lr_lambda",
           "token_digest"]


def report_step(report: Callable[..., None], m: dict, steps_per_s: float) -> None:
    """One step's figures to the stream (its next heartbeat carries them to the sidecar's
    ``/metrics``), every step: it only stores them. A loss the wire refuses (NaN after a
    divergence, past its bound) goes as none, so the step and speed still show."""
    kw = {"step": m["step"], "steps_per_s": steps_per_s, "samples_per_s": m["samples_per_s"]}
    try:
        report(loss=m["loss"], **kw)
    except ValueError:
        report(loss=None, **kw)


def token_digest(token_ids: torch.Tensor) -> str:
    """A sample's identity by content: the same text streamed again (next epoch, new key) matches."""
    return hashlib.blake2b(token_ids.to(torch.int64).contiguous().numpy().tobytes(), digest_size=16).hexdigest()


class OnlineTrainer:
    """Build (or resume) a draft and train it on a stream.

    ``draft``: the plug-in instance (default: ``cfg.draft`` from the registry, made from the
    config and the verifier's config).

    ``token_counts`` feed the draft vocabulary maps on a fresh start (ignored on resume: the
    maps are part of the run). ``drained`` is asked before each step with the number of
    samples used but not yet acknowledged; it answers whether nothing else can arrive for
    the followed jobs, in which case the trainer checkpoints and acknowledges right away (the
    sidecar only ends a job once every sample is acknowledged, so without this a deferred-ack
    trainer would wait for the end of a job that waits for it). With several ranks only rank 0
    asks and the ranks act on its answer together.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        token_counts: dict[int, int] | None = None,
        *,
        drained: Callable[[int], bool] | None = None,
        resume: bool = True,
        world: World | None = None,
        draft: Draft | None = None,
    ) -> None:
        if cfg.eval_ids is not None:
            cfg.eval_ids = tuple(cfg.eval_ids)
        check_fraction(cfg.eval_fraction)
        if cfg.eval_fraction > 0 and cfg.eval_ids is not None:
            raise ValueError("give --eval-ids or --eval-fraction, not both")
        if cfg.eval_every < 0 or (cfg.eval_every > 0 and cfg.eval_samples < 1):
            raise ValueError(f"--eval-every must be >= 0 and --eval-samples >= 1 (got {cfg.eval_every}, {cfg.eval_samples})")
        if cfg.checkpoint_every_s is not None and cfg.checkpoint_every_s <= 0:
            raise ValueError(f"--checkpoint-every-s must be > 0 (got {cfg.checkpoint_every_s})")
        self.cfg = cfg
        self.world = world or World()
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.token_counts = token_counts
        self.drained = drained
        self.resume = resume
        self.device = resolve_device(cfg.device, local_rank=self.world.local_rank if self.world.distributed else None,
                                     world_size=self.world.size)  # fmt: skip
        self.autocast = resolve_autocast(cfg.autocast, self.device)
        self.prefetch = cfg.prefetch if cfg.prefetch is not None else (1 if self.device.type == "cuda" else 0)
        vcfg = M.verifier_text_config(cfg.verifier)
        self.draft = draft if draft is not None else D.get(cfg.draft)(cfg, vcfg)
        self.k = int(self.draft.positions())  # draft positions the metrics count
        self.num_hidden_layers = int(vcfg["num_hidden_layers"])
        self.hidden_size = int(vcfg["hidden_size"])
        self.vocab_size = int(vcfg["vocab_size"])
        self.draft_vocab_size = min(cfg.draft_vocab_size or 32000, self.vocab_size)
        self.model = None
        self.stepper: DraftStep | None = None
        self.policy: CheckpointPolicy | None = None
        self.ops = None
        self.samples_trained = 0
        self.tokens_trained = 0
        self.aux_layer_ids: list[int] | None = None
        self._metrics: L.MetricLoggers | None = None  # TensorBoard, W&B (rank 0)
        self.resumed_from: Path | None = None
        self.resumed_step: int | None = None
        self.stop_report: list[str] | None = None  # what a stop (Ctrl-C, SIGTERM) left behind: stop_lines()
        self.data_stats: dict = {}  # of the last train(): batches copied through the side stream, ...
        self.heldout_ids: set[str] = set()  # with cfg.eval_ids: the ids held out so far
        self.heldout: list[Features] = []  # in memory only; bounded by cfg.eval_samples (rank 0)
        self.heldout_digests: set[str] = set()  # kept in checkpoints: a resumed run never trains on them
        self.heldout_repeats = 0
        self.held_out_by_fraction = 0
        self._fraction_kept: set[tuple[str, str]] = set()  # (job, identity) kept for eval_every (this run)

    @property
    def step(self) -> int:
        return self.stepper.step if self.stepper is not None else 0

    @property
    def optimizer(self):  # noqa: ANN201
        return self.stepper.optimizer if self.stepper is not None else None

    @property
    def scheduler(self):  # noqa: ANN201
        return self.stepper.scheduler if self.stepper is not None else None

    def stream_options(self) -> dict:
        """What the stream feeding this trainer should be opened with: pinned samples on CUDA
        (non-blocking copies), and idle yields (checkpoints at a job's tail, ranks in step)."""
        return {"pin_memory": self.device.type == "cuda", "idle_s": self.cfg.idle_s}

    # -- setup ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build (or restore) draft, optimizer and maps *before* the stream is touched.

        Done first because it is slow (speculators' import, the verifier's embeddings and
        lm_head): a stream that sat idle that long without heartbeats would be presumed dead
        by the sidecar and lose its leases. The aux layers are therefore fixed here (given,
        restored, or the draft's default) and the first sample is checked against them.
        """
        if self.model is not None:
            return
        cfg, world = self.cfg, self.world
        which = L.names(cfg.logger, tensorboard=cfg.tensorboard)  # first, and on every rank: the same error everywhere
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        n = self.num_hidden_layers
        ckpt = M.latest_checkpoint(self.out) if self.resume else None
        ckpt = world.broadcast(str(ckpt) if ckpt is not None else None)  # rank 0's choice for every rank
        ckpt = Path(ckpt) if ckpt is not None else None
        if ckpt is not None:
            state = M.load_state(ckpt)
            was = state.get("draft", "eagle3")
            if was != self.draft.name:
                raise ValueError(f"{self.out} holds a {was} run, not {self.draft.name}: use another --out")
            self.aux_layer_ids = list(state["aux_layer_ids"])
            maps = torch.load(self.out / VOCAB_FILE, weights_only=True)
            self.draft_vocab_size = int(state["draft_vocab_size"])
            t2d, d2t = maps.get("t2d"), maps.get("d2t")
        else:
            from trainer_client.train.vocab import build_vocab_maps, coverage

            init = None
            if cfg.init_draft:  # warm start: the serving draft decides layers and vocabulary (warm_start.py)
                from trainer_client.train.warm_start import read_init_draft

                init = read_init_draft(cfg.init_draft, self.vocab_size)
                if init.speculators_type not in (None, self.draft.speculators_type):
                    raise ValueError(f"--init-draft {cfg.init_draft} is a {init.speculators_type} draft, not "
                                     f"{self.draft.speculators_type}: pass --draft to match it")  # fmt: skip
            self.aux_layer_ids = self.draft.layers(init.aux_layer_ids if init and init.aux_layer_ids else cfg.aux_layer_ids)
            if init is not None:
                self.draft_vocab_size = min(init.draft_vocab_size or self.vocab_size, self.vocab_size)
                d2t, t2d = init.d2t, init.t2d
            else:
                d2t, t2d = build_vocab_maps(self.token_counts, self.draft_vocab_size, self.vocab_size)
            cov = coverage(self.token_counts or {}, t2d)
            if world.is_writer:
                torch.save({"t2d": t2d, "d2t": d2t, "draft_vocab_size": self.draft_vocab_size}, self.out / VOCAB_FILE)
                log.info("draft vocabulary %d of %d tokens, covering %.4f of counted tokens", self.draft_vocab_size,
                         self.vocab_size, cov)  # fmt: skip
                run = {
                    "config": asdict(cfg),
                    "aux_layer_ids": self.aux_layer_ids,
                    **self.draft.describe(),
                    "num_hidden_layers": n,
                    "draft_vocab_size": self.draft_vocab_size,
                    "vocab_coverage": cov,
                    "device": str(self.device),
                    "autocast": str(self.autocast).removeprefix("torch.") if self.autocast else None,
                    "world_size": world.size,
                    "started": time.time(),
                }
                (self.out / RUN_FILE).write_text(json.dumps(run, indent=2, default=str) + "\n")
            state = None
        self.model = self.draft.build(self.aux_layer_ids, draft_vocab_size=self.draft_vocab_size, t2d=t2d, d2t=d2t,
                                      seed=cfg.seed)  # fmt: skip
        if state is not None:
            self.draft.load_weights(self.model, ckpt / M.DRAFT_DIR)
        elif cfg.init_draft:
            self.draft.load_weights(self.model, init.path)  # type: ignore[union-attr]
            log.info("warm start: the draft's weights from %s", init.path)  # type: ignore[union-attr]
        # the draft and the verifier's frozen parts (embeddings, norm, lm_head rows) on the device
        self.model.to(self.device)
        world.broadcast_module_(self.model)
        self.ops = device_ops(self.device)
        self.stepper = DraftStep(self.model, cfg, self.device, world, self.autocast, self.ops, self.draft)
        skip: set[str] = set()
        if state is not None:
            self.stepper.optimizer.load_state_dict(state["optimizer"])
            self.stepper.scheduler.load_state_dict(state["scheduler"])
            self.stepper.step = int(state["step"])
            self.samples_trained = int(state["samples_trained"])
            self.tokens_trained = int(state["tokens_trained"])
            skip = set(state["unacked_keys"])
            self.heldout_digests = set(state.get("heldout_digests", []))
            self.heldout_ids = set(state.get("heldout_ids", []))
            self.resumed_from, self.resumed_step = ckpt, self.step
            log.info("resumed from %s at step %d (%d samples); %d keys possibly unacknowledged", ckpt, self.step,
                     self.samples_trained, len(skip))  # fmt: skip
        self.policy = CheckpointPolicy(self.out, cfg.checkpoint_every, world, skip)
        if which and world.is_writer and self._metrics is None:
            self._metrics = L.MetricLoggers(which, self.out, cfg)

    @property
    def skip_keys(self) -> set[str]:
        return self.policy.skip_keys if self.policy is not None else set()

    def check(self, smp: Sample) -> None:
        """The stream carries what this draft trains from: layer N, its aux layers, its hidden size."""
        self.draft.check(smp, self.aux_layer_ids or [])

    # -- in-run evaluation ----------------------------------------------------------------------
    def _hold_out(self, smp: Sample, key: str | None = None) -> bool:  # noqa: ARG002 - key: older callers
        """Keep the first ``eval_samples`` samples (or those named by ``eval_ids``) for
        evaluation; True if ``smp`` is not to be trained on."""
        cfg = self.cfg
        if cfg.eval_fraction > 0:
            return self._hold_out_by_fraction(smp)
        if cfg.eval_every <= 0 or not self.world.is_writer:
            return False
        if cfg.eval_ids is not None:
            if smp.label not in cfg.eval_ids:  # before any hashing: this runs for every sample
                return False
            if smp.label in self.heldout_ids:  # again (next epoch, or regenerated: other tokens)
                self.heldout_repeats += 1
                return True
            self.heldout_ids.add(smp.label)
            dg = token_digest(smp.token_ids)
            if smp.token_ids.shape[0] < 2:
                return True  # nothing to evaluate on, and still not to be trained on
        elif (dg := token_digest(smp.token_ids)) in self.heldout_digests:  # again (next epoch): it would leak
            self.heldout_repeats += 1
            return True
        elif len(self.heldout) >= cfg.eval_samples or smp.token_ids.shape[0] < 2:
            return False
        f = self.draft.features(smp, self.aux_layer_ids or [])  # copied: the stream may hand its buffers back
        self.heldout.append(Features(str(smp.key), f.input_ids.clone(), f.aux.clone(), f.last.clone(),
                                     f.loss_mask.clone()))  # fmt: skip
        self.heldout_digests.add(dg)
        return True

    def _hold_out_by_fraction(self, smp: Sample) -> bool:
        """``eval_fraction``: the samples :func:`held_out` picks, on every rank and epoch (the
        rule reads only the sample's id or index and the seed, so ``hsstream eval --job`` picks
        the same). Rank 0 keeps the first ``eval_samples`` of them for ``eval_every``."""
        cfg = self.cfg
        index = smp.key.index if smp.key is not None else -1
        ident = sample_identity(smp.label, index)
        if (smp.key is None and smp.label is None) or not held_out(ident, cfg.eval_fraction, cfg.eval_seed):
            return False
        self.held_out_by_fraction += 1
        seen = (smp.key.job if smp.key is not None else "", ident)  # an identity is a job's own
        if (cfg.eval_every > 0 and self.world.is_writer and seen not in self._fraction_kept
                and len(self.heldout) < cfg.eval_samples and smp.token_ids.shape[0] >= 2):  # fmt: skip
            self._fraction_kept.add(seen)
            f = self.draft.features(smp, self.aux_layer_ids or [])  # copied: the stream may hand its buffers back
            self.heldout.append(Features(str(smp.key), f.input_ids.clone(), f.aux.clone(), f.last.clone(),
                                         f.loss_mask.clone()))  # fmt: skip
        return True

    def evaluate(self, stream=None) -> dict:  # noqa: ANN001
        """Top-1 per draft position on the held-out samples (token-weighted), without a gradient, on
        the training device and precision.

        Heartbeats go out before, between samples and after, as around a checkpoint, so the
        stream's leases do not lapse however long the evaluation takes.
        """
        assert self.model is not None and self.stepper is not None
        keepalive = getattr(stream, "keepalive", None)
        k = self.k
        sums, tots, loss_sum = [0.0] * k, [0.0] * k, 0.0
        t0 = time.perf_counter()
        self.model.eval()
        try:
            with torch.no_grad():
                for f in self.heldout:
                    if keepalive:
                        keepalive()
                    row = self.draft.pack([f])
                    if self.device.type == "cuda":
                        row = self.draft.device_row(row)  # the shapes the step compiled for
                    batch = {name: t.to(self.device) for name, t in row.items()}
                    with self.stepper._autocast():
                        loss, correct, counted = self.draft.forward(self.model, batch)
                    loss_sum += float(loss)
                    for i in range(k):
                        sums[i] += float(correct[i])
                        tots[i] += float(counted[i])
        finally:
            self.model.train()
        if keepalive:
            keepalive()
        out: dict = {"step": self.step, "eval_samples": len(self.heldout)}
        for i in range(k):
            out[f"eval_top1_{i}"] = sums[i] / tots[i] if tots[i] else 0.0
        out["eval_loss"] = loss_sum / max(1, len(self.heldout))
        out["eval_tokens"] = tots[0]
        out["eval_s"] = round(time.perf_counter() - t0, 3)
        return out

    def _eval_and_log(self, stream, metrics_log, history: list[dict]) -> dict:  # noqa: ANN001
        e = self.evaluate(stream)
        if metrics_log is not None:
            metrics_log.write(json.dumps(e) + "\n")
        history.append(e)
        log.info("step %d held-out top1 %s (%d samples, %.2f s)", self.step,
                 "/".join(f"{e[f'eval_top1_{i}']:.3f}" for i in range(self.k)), len(self.heldout),
                 e["eval_s"])  # fmt: skip
        if self._metrics is not None:
            self._metrics.log({f"eval/{k.removeprefix('eval_')}": v for k, v in e.items()
                               if k.startswith("eval_") and k != "eval_samples"}, self.step)  # fmt: skip
        return e

    # -- checkpoint ---------------------------------------------------------------------------
    def _save(self, unacked: list[str]) -> Path:
        st = self.stepper
        assert self.model is not None and st is not None
        state = {
            "step": st.step,
            "samples_trained": self.samples_trained,
            "tokens_trained": self.tokens_trained,
            "optimizer": st.optimizer.state_dict(),
            "scheduler": st.scheduler.state_dict(),
            "aux_layer_ids": self.aux_layer_ids,
            "draft": self.draft.name,
            "draft_vocab_size": self.draft_vocab_size,
            # Included in these weights, not yet acknowledged when they were written (all ranks).
            "unacked_keys": unacked,
            "heldout_digests": sorted(self.heldout_digests),
            "heldout_ids": sorted(self.heldout_ids),
            "writer": {"rank": self.world.rank, "pid": os.getpid(), "world_size": self.world.size},
            "time": time.time(),
        }
        return M.save_checkpoint(self.out, st.step, self.model, state, keep=self.cfg.keep_checkpoints)

    def _checkpoint(self, stream) -> Path:  # noqa: ANN001
        assert self.policy is not None
        return self.policy.checkpoint(stream, self.step, self._save)

    # -- loop ---------------------------------------------------------------------------------
    def train(self, stream: Iterable[Sample | None]) -> TrainResult:
        """Train until every rank's stream ends or ``max_steps``; checkpoints, acks, logs on the way."""
        cfg, world = self.cfg, self.world
        self.prepare()
        assert self.stepper is not None and self.policy is not None
        if world.distributed and getattr(stream, "idle_s", None) is None:
            raise ValueError("with several ranks the stream must yield when idle (HiddenStateStream(idle_s=...)): "
                             "a rank blocked on its stream cannot join the others' steps")  # fmt: skip
        policy = self.policy
        source = BatchSource(stream, check=self.check, already_trained=policy.already_trained,
                             samples_per_step=cfg.samples_per_step, max_tokens_per_step=cfg.max_tokens_per_step,
                             control=cfg.control, hold_out=self._hold_out,
                             count_loss=self.draft.loss_tokens)  # fmt: skip
        copier = DeviceCopier(self.device, self.aux_layer_ids or [], self.ops, self.draft)
        pre = Prefetcher(source, copier, self.prefetch)
        t_start = time.perf_counter()
        step0, report = self.step, getattr(stream, "report", None)  # HiddenStateStream.report, if the stream has it
        wait_s = 0.0
        history: list[dict] = []
        skipped = no_loss = 0
        global_pending = 0
        run = {"samples": 0, "tokens": 0}  # this rank
        g_run = {"samples": 0, "tokens": 0}  # all ranks
        bar = None
        metrics_log = None
        keys_log: Path | None = None
        last_eval: dict | None = None
        origin = cfg.clock_origin if cfg.clock_origin is not None else time.time()
        every_s = cfg.checkpoint_every_s
        next_due_s = (math.floor((time.time() - origin) / every_s) + 1) * every_s if every_s else math.inf
        # a stop asked for ends at a step boundary, checkpointed; a stream that yields when idle is never interrupted
        stop = GracefulStop(interrupt_waits=getattr(stream, "idle_s", None) is None).install()
        try:
            while True:
                if cfg.max_steps is not None and self.step >= cfg.max_steps:
                    break
                t0 = time.perf_counter()
                try:
                    with stop.waiting():
                        st = pre.take()
                except StopWhileWaiting:
                    st = None
                wait_s += time.perf_counter() - t0
                if keys_log is None and source.seen:  # the first sample passed the checks
                    keys_log = self.out / KEYS_LOG
                    if world.is_writer:
                        metrics_log = open(self.out / METRICS_LOG, "a", buffering=1)  # noqa: SIM115
                        if cfg.progress:
                            from tqdm import tqdm

                            bar = tqdm(total=cfg.max_steps, initial=self.step, desc=self.draft.name, unit="step",
                                       dynamic_ncols=True)  # fmt: skip
                hb = st.host if st is not None else None
                n_samples = len(hb.samples) if hb else 0
                n_loss = hb.loss_tokens if hb else 0
                n_tokens = st.tokens if st is not None else 0
                pending_after = len(policy.pending) + (len(hb.yielded) if hb else 0)
                ended = pre.exhausted
                drained = False
                if self.drained is not None and not ended and (pending_after > 0 or global_pending > 0):
                    drained = bool(self.drained(max(pending_after, global_pending)))
                # the wall-clock checkpoint is rank 0's call (one clock for all ranks)
                clock_due = int(world.is_writer and time.time() - origin >= next_due_s)
                asked = int(stop.asked is not None)
                g = world.sum([n_samples, n_loss, n_tokens, int(ended), pending_after, int(drained), clock_due, asked])
                g_samples, g_loss, g_tokens, g_ended, global_pending, g_drained, g_clock, g_stop = (int(x) for x in g)
                all_ended = g_ended >= world.size
                if hb is not None:
                    policy.used(hb)
                    skipped += hb.skipped
                    no_loss += hb.no_loss
                stepped = g_samples > 0
                if stepped:
                    batch = copier.ready(st) if st is not None and st.tensors is not None else None
                    h = self.stepper.launch(batch, n_loss, g_loss)
                    last = cfg.max_steps is not None and self.step >= cfg.max_steps
                    t_fill = None
                    if pre.depth and not (all_ended or g_drained or last):
                        t1 = time.perf_counter()
                        try:
                            with stop.waiting():
                                pre.fill()  # the next batch: fetched, checked and copied while the device works
                        except StopWhileWaiting:
                            pass  # this step still ends and is saved; the next batch's samples come again
                        t_fill = (t1, time.perf_counter())
                    m, device_s = self.stepper.finish(h)
                    if t_fill is not None:  # only what the device spent idle counts as waiting
                        wait_s += max(0.0, t_fill[1] - max(t_fill[0], h.t0 + device_s))
                    st = None  # the step is done: the host tensors of its batch may go
                    self.samples_trained += g_samples
                    self.tokens_trained += g_tokens
                    run["samples"] += n_samples
                    run["tokens"] += n_tokens
                    g_run["samples"] += g_samples
                    g_run["tokens"] += g_tokens
                    elapsed = time.perf_counter() - t_start
                    m.update(samples_per_s=g_run["samples"] / elapsed, wait_frac=wait_s / elapsed,
                             samples=self.samples_trained)  # fmt: skip
                    history.append(m)
                    if hb is not None and hb.samples and keys_log is not None:
                        append_line(keys_log, {"step": self.step, "keys": hb.keys, "pid": os.getpid(),
                                               "rank": world.rank})  # fmt: skip
                    self._log_step(m, metrics_log, bar)
                    if report is not None:
                        report_step(report, m, (self.step - step0) / elapsed)
                    if cfg.eval_every > 0 and self.heldout and self.step % cfg.eval_every == 0:
                        last_eval = self._eval_and_log(stream, metrics_log, history)
                at_end = all_ended or (cfg.max_steps is not None and self.step >= cfg.max_steps)
                clock = bool(stepped and g_clock and global_pending > 0)
                if clock:
                    next_due_s = (math.floor((time.time() - origin) / every_s) + 1) * every_s
                if policy.due(self.step, stepped, at_end, bool(g_drained), global_pending) or clock:
                    self._checkpoint(stream)
                    global_pending = 0
                if g_stop and not all_ended:  # asked on some rank: every step trained is saved, then the stop
                    if global_pending > 0:
                        self._checkpoint(stream)
                    if stop.asked is None:
                        raise SystemExit(0)  # another rank was asked: this one ends with it
                    stop.resume()
                if all_ended:
                    break
            if cfg.eval_every > 0 and self.heldout and (last_eval is None or last_eval["step"] != self.step):
                last_eval = self._eval_and_log(stream, metrics_log, history)  # the final weights' figure
            g_seen, g_pending = (int(x) for x in world.sum([source.seen, len(policy.pending)]))
            if g_seen == 0:  # not a single sample came, to any rank
                if self.resumed_from is None:
                    raise RuntimeError("the stream ended before delivering any sample: nothing to train on")
                # resumed after the jobs were complete: the newest checkpoint is the result
                return self._result(history, {"samples": 0, "tokens": 0}, run, 0, time.perf_counter() - t_start,
                                    wait_s, self.resumed_from, last_eval)  # fmt: skip
            if policy.last_path is None or g_pending or policy.last_step != self.step:
                self._checkpoint(stream)
            if stop.asked is not None:  # asked as the run ended: saved above, and the stop goes on (not swallowed)
                stop.resume()
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM under `hsstream train` (exit_0_on_stop)
            self.stop_report = self.stop_lines(stream)
            for line in self.stop_report:
                log.warning("%s", line)
            raise
        finally:
            stop.close()
            self.data_stats = {"staged": copier.staged, "prefetch": pre.depth, "samples_seen": source.seen}
            if bar is not None:
                bar.close()
            if metrics_log is not None:
                metrics_log.close()
            if self._metrics is not None:
                self._metrics.close()  # W&B's run ends with the training
                self._metrics = None
        return self._result(history, g_run, run, skipped, time.perf_counter() - t_start, wait_s, policy.last_path,
                            last_eval, no_loss=no_loss)  # fmt: skip

    def _log_step(self, m: dict, metrics_log, bar) -> None:  # noqa: ANN001
        cfg = self.cfg
        if metrics_log is not None and (self.step % cfg.log_every == 0 or self.step == 1):
            metrics_log.write(json.dumps(m) + "\n")
            log.info(
                "step %d loss %.4f top1 %s lr %.2e %.1f samples/s wait %.0f%%", self.step, m["loss"],
                "/".join(f"{m[f'top1_{i}']:.2f}" for i in range(self.k)), m["lr"],
                m["samples_per_s"], 100 * m["wait_frac"],
            )  # fmt: skip
            if self._metrics is not None:
                self._metrics.log({f"train/{k}": v for k, v in m.items() if k != "step"}, self.step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", top1=f"{m['top1_0']:.2f}", sps=f"{m['samples_per_s']:.1f}",
                            wait=f"{m['wait_frac']:.0%}")  # fmt: skip

    def stop_lines(self, stream=None) -> list[str]:  # noqa: ANN001
        """Two lines on a run stopped mid-way: what is saved (the newest checkpoint and its step,
        which a run on the same out dir resumes from) and what comes back (every sample delivered
        since that checkpoint is unacknowledged -- acks follow checkpoints -- so the sidecar
        produces it again once this trainer's lease lapses; its jobs stay open meanwhile)."""
        p = self.policy
        path, at = (p.last_path, p.last_step) if p is not None and p.last_path is not None else (
            self.resumed_from, self.resumed_step)  # fmt: skip
        if path is not None:
            first = (f"stopped at step {self.step}: saved {path} (step {at}); a run with the same out dir "
                     f"({self.out}) resumes from it, on the same jobs")  # fmt: skip
        else:
            first = (f"stopped at step {self.step}, before the first checkpoint: nothing saved; a run with the same "
                     f"out dir ({self.out}) starts over, on the same jobs")  # fmt: skip
        n = getattr(stream, "unacked", None)
        if n is None:
            n = len(p.pending) if p is not None else 0
        lease = getattr(stream, "lease_s", None)
        when = (f"after {lease:.0f} s without word from this trainer (its lease)" if lease
                else "once this trainer's lease lapses")  # fmt: skip
        since = (f", and the {self.step - at} step(s) trained since are not saved" if at is not None and self.step > at
                 else "")  # fmt: skip
        second = (f"{n} sample(s) delivered {'since then' if path is not None else 'to this run'} are not "
                  f"acknowledged{since}: the sidecar hands them out again {when}; the jobs stay open on the sidecar "
                  "until every sample is acknowledged")  # fmt: skip
        return [first, second]

    def _result(self, history, g_run, run, skipped, wall, wait, ckpt, last_eval=None, window: int = 50,  # noqa: ANN001
                no_loss: int = 0) -> TrainResult:
        k = self.k
        tail = [h for h in history if "loss" in h][-window:]
        top1 = []
        for i in range(k):
            n = sum(h[f"n_{i}"] for h in tail)
            top1.append(sum(h[f"top1_{i}"] * h[f"n_{i}"] for h in tail) / n if n else 0.0)
        loss = sum(h["loss"] for h in tail) / len(tail) if tail else float("nan")
        final = serve = spec = refused = None
        if ckpt is not None and self.world.is_writer:
            final = M.publish_final(self.out, Path(ckpt))
            try:
                spec = self.draft.speculative_config(final)
            except D.NotServable as e:  # the installed vLLM would refuse it (the draft's plug-in says why)
                refused = str(e)
                log.warning("the trained draft is in %s; %s", final, refused)
            else:
                serve = M.serve_command(self.cfg.verifier, final, spec=spec)
                log.info("the trained draft is in %s; serve it with:\n%s", final, serve)
        ranks = self.world.gather({"rank": self.world.rank, "device": str(self.device), "samples": run["samples"],
                                   "tokens": run["tokens"], "wait_s": round(wait, 2), "pid": os.getpid()})  # fmt: skip
        return TrainResult(
            steps=self.step, samples=g_run["samples"], tokens=g_run["tokens"], skipped_already_trained=skipped,
            wall_s=round(wall, 2), wait_s=round(wait, 2), final_checkpoint=str(ckpt) if ckpt else None,
            draft_dir=str(ckpt / M.DRAFT_DIR) if ckpt else None, top1=top1, loss=loss, window=len(tail),
            device=str(self.device), autocast=str(self.autocast).removeprefix("torch.") if self.autocast else None,
            world_size=self.world.size, ranks=ranks, history=history,  # type: ignore[arg-type]
            eval_top1=[last_eval[f"eval_top1_{i}"] for i in range(k)] if last_eval else None,
            held_out=len(self.heldout), held_out_by_fraction=self.held_out_by_fraction, final_dir=str(final) if final else None, serve=serve,
            draft=self.draft.name, speculative_config=spec, skipped_no_loss=no_loss, serve_refused=refused,
        )  # fmt: skip
