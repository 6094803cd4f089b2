"""Online Eagle-3 training from a :class:`~trainer_client.HiddenStateStream`.

Each step takes fresh samples from the stream (never stored, never revisited), packs them
into one row, and runs speculators' Eagle-3 forward with test-time training (TTT) steps:
targets are the frozen verifier's softmax(lm_head(norm(layer N))) over the draft vocabulary,
the loss a KL divergence masked by the loss mask.

Crash consistency is the point of the checkpoint design. Samples are acknowledged to the
sidecar only right after a checkpoint that includes them is on disk (stream ``ack="manual"``,
``ack_through``). So after a SIGKILL the sidecar hands back exactly the samples the newest
checkpoint does not include, and the resumed run trains on those and on nothing it already
has. The one window left (killed after writing a checkpoint, before its ack left) is closed by
storing in the checkpoint the keys it includes but had not acknowledged yet: the resumed run
acknowledges those again without training on them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from connector import protocol as P
from trainer_client.eagle3 import model as M
from trainer_client.eagle3.features import Features, MissingLayersError, eagle3_layers, features, pack, swap_aux
from trainer_client.stream import Sample

log = logging.getLogger("hsstream.eagle3")

RUN_FILE = "run.json"
VOCAB_FILE = "vocab_maps.pt"
KEYS_LOG = "trained_keys.jsonl"
METRICS_LOG = "metrics.jsonl"


@dataclass
class TrainConfig:
    verifier: str
    out_dir: str
    aux_layer_ids: list[int] | None = None  # None: Eagle-3's usual [2, N//2, N-3]
    draft_vocab_size: int | None = None  # None: min(32000, verifier vocabulary)
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    schedule_steps: int | None = None  # length of the decay; default max_steps
    max_steps: int | None = None  # stop after this many optimizer steps (None: until the stream ends)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    samples_per_step: int = 1
    max_tokens_per_step: int = 4096
    checkpoint_every: int = 100
    # Also checkpoint at each multiple of this many seconds after ``clock_origin`` (a time.time();
    # default: the start of training), so that runs can be compared at equal wall-clock points.
    checkpoint_every_s: float | None = None
    clock_origin: float | None = None
    keep_checkpoints: int = 2  # 0: keep all
    # In-run proxy of acceptance: every ``eval_every`` steps, top-1 per TTT step on the first
    # ``eval_samples`` samples of the stream, held out (never trained on, nor their repeats).
    eval_every: int = 0
    eval_samples: int = 8
    log_every: int = 10
    seed: int = 0
    train_lm_head: bool = False
    control: str = "none"  # "swap-hidden": negative control, aux states from another sample
    tensorboard: bool = True
    progress: bool = True
    threads: int | None = None
    extra: dict = field(default_factory=dict)  # recorded in run.json (job ids, command line, ...)


@dataclass
class TrainResult:
    steps: int
    samples: int
    tokens: int
    skipped_already_trained: int
    wall_s: float
    wait_s: float
    final_checkpoint: str | None
    draft_dir: str | None
    top1: list[float]  # per TTT step, token-weighted over the last ``window`` steps
    loss: float
    window: int
    history: list[dict] = field(default_factory=list, repr=False)
    eval_top1: list[float] | None = None  # the last held-out evaluation (``eval_every``)
    held_out: int = 0  # samples held out for it (their repeats in later epochs are not trained either)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("history")
        return d


def token_digest(token_ids: torch.Tensor) -> str:
    """A sample's identity by content: the same text streamed again (next epoch, new key) matches."""
    return hashlib.blake2b(token_ids.to(torch.int64).contiguous().numpy().tobytes(), digest_size=16).hexdigest()


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    total = cfg.schedule_steps or cfg.max_steps

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / max(1, cfg.warmup_steps)
        if cfg.schedule == "constant" or not total:
            return 1.0
        p = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        if cfg.schedule == "linear":
            return 1.0 - (1.0 - cfg.min_lr_ratio) * p
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))

    return f


class Eagle3OnlineTrainer:
    """Build (or resume) a draft and train it on a stream.

    ``token_counts`` feed the draft vocabulary maps on a fresh start (ignored on resume: the
    maps are part of the run). ``drained`` is asked after each step with the number of
    samples used but not yet acknowledged; it answers whether nothing else can arrive for
    the followed jobs, in which case the trainer checkpoints and acknowledges right away (the
    sidecar only ends a job once every sample is acknowledged, so without this a deferred-ack
    trainer would wait for the end of a job that waits for it).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        token_counts: dict[int, int] | None = None,
        *,
        drained: Callable[[int], bool] | None = None,
        resume: bool = True,
    ) -> None:
        if cfg.eval_every < 0 or (cfg.eval_every > 0 and cfg.eval_samples < 1):
            raise ValueError(f"--eval-every must be >= 0 and --eval-samples >= 1 (got {cfg.eval_every}, {cfg.eval_samples})")
        if cfg.checkpoint_every_s is not None and cfg.checkpoint_every_s <= 0:
            raise ValueError(f"--checkpoint-every-s must be > 0 (got {cfg.checkpoint_every_s})")
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.token_counts = token_counts
        self.drained = drained
        self.resume = resume
        vcfg = M.verifier_text_config(cfg.verifier)
        self.num_hidden_layers = int(vcfg["num_hidden_layers"])
        self.hidden_size = int(vcfg["hidden_size"])
        self.vocab_size = int(vcfg["vocab_size"])
        self.draft_vocab_size = min(cfg.draft_vocab_size or 32000, self.vocab_size)
        self.model = None
        self.optimizer = None
        self.scheduler = None
        self.step = 0
        self.samples_trained = 0
        self.tokens_trained = 0
        self.skip_keys: set[str] = set()  # in the resumed weights, maybe never acknowledged
        self.aux_layer_ids: list[int] | None = None
        self._tb = None
        self.resumed_from: Path | None = None
        self.heldout: list[Features] = []  # in memory only; bounded by cfg.eval_samples
        self.heldout_digests: set[str] = set()  # kept in checkpoints: a resumed run never trains on them
        self.heldout_repeats = 0

    # -- setup ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build (or restore) draft, optimizer and maps *before* the stream is touched.

        Done first because it is slow (speculators' import, the verifier's embeddings and
        lm_head): a stream that sat idle that long without heartbeats would be presumed dead
        by the sidecar and lose its leases. The aux layers are therefore fixed here (given,
        restored, or Eagle-3's usual [2, N//2, N-3]) and the first sample is checked against
        them.
        """
        if self.model is not None:
            return
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        n = self.num_hidden_layers
        ckpt = M.latest_checkpoint(self.out) if self.resume else None
        if ckpt is not None:
            state = M.load_state(ckpt)
            self.aux_layer_ids = list(state["aux_layer_ids"])
            maps = torch.load(self.out / VOCAB_FILE, weights_only=True)
            self.draft_vocab_size = int(state["draft_vocab_size"])
            t2d, d2t = maps.get("t2d"), maps.get("d2t")
        else:
            self.aux_layer_ids = sorted(cfg.aux_layer_ids) if cfg.aux_layer_ids else [2, n // 2, n - 3]
            if len(self.aux_layer_ids) != 3 or not all(0 <= i < n for i in self.aux_layer_ids):
                raise MissingLayersError(f"Eagle-3 takes three aux layers below N={n}, got {self.aux_layer_ids}")
            from trainer_client.eagle3.vocab import build_vocab_maps, coverage

            d2t, t2d = build_vocab_maps(self.token_counts, self.draft_vocab_size, self.vocab_size)
            torch.save({"t2d": t2d, "d2t": d2t, "draft_vocab_size": self.draft_vocab_size}, self.out / VOCAB_FILE)
            cov = coverage(self.token_counts or {}, t2d)
            log.info("draft vocabulary %d of %d tokens, covering %.4f of counted tokens", self.draft_vocab_size,
                     self.vocab_size, cov)  # fmt: skip
            run = {
                "config": asdict(cfg),
                "aux_layer_ids": self.aux_layer_ids,
                "num_hidden_layers": n,
                "draft_vocab_size": self.draft_vocab_size,
                "vocab_coverage": cov,
                "started": time.time(),
            }
            (self.out / RUN_FILE).write_text(json.dumps(run, indent=2, default=str) + "\n")
            state = None
        self.model = M.build_draft(
            cfg.verifier, self.aux_layer_ids, draft_vocab_size=self.draft_vocab_size, t2d=t2d, d2t=d2t,
            ttt_steps=cfg.ttt_steps, seed=cfg.seed, train_lm_head=cfg.train_lm_head,
        )  # fmt: skip
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        if state is not None:
            M.load_weights(self.model, ckpt)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            self.samples_trained = int(state["samples_trained"])
            self.tokens_trained = int(state["tokens_trained"])
            self.skip_keys = set(state["unacked_keys"])
            self.heldout_digests = set(state.get("heldout_digests", []))
            self.resumed_from = ckpt
            log.info("resumed from %s at step %d (%d samples); %d keys possibly unacknowledged", ckpt, self.step,
                     self.samples_trained, len(self.skip_keys))  # fmt: skip
        from speculators.losses import resolve_loss_config

        self.loss_config = resolve_loss_config("kl_div", "eager")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out / "tensorboard"))
            except ImportError:
                self._tb = None

    def check(self, smp: Sample) -> None:
        """The stream carries what this draft trains from: layer N, its aux layers, its hidden size."""
        eagle3_layers(smp, self.aux_layer_ids, self.num_hidden_layers)
        if smp.hidden_states.shape[-1] != self.hidden_size:
            raise MissingLayersError(
                f"sample {smp.key} has hidden size {smp.hidden_states.shape[-1]}, the verifier {self.hidden_size}"
            )

    # -- one step ---------------------------------------------------------------------------------
    def train_step(self, items: list[Features]) -> dict:
        assert self.model is not None and self.optimizer is not None and self.scheduler is not None
        batch = pack(items)
        self.model.train()
        _, loss, metrics = self.model(
            **batch, ttt_steps=self.cfg.ttt_steps, ttt_step_loss_decay=self.cfg.ttt_step_loss_decay,
            loss_config=self.loss_config,
        )  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        k = self.cfg.ttt_steps
        out = {
            "step": self.step,
            "loss": float(loss.detach()),
            "grad_norm": float(gnorm),
            "lr": self.scheduler.get_last_lr()[0],
            "tokens": int(batch["loss_mask"].sum()),
        }
        for i in range(k):
            tot = float(metrics[f"full_acc_{i}_total"])
            out[f"top1_{i}"] = float(metrics[f"full_acc_{i}_sum"]) / tot if tot else 0.0
            out[f"n_{i}"] = tot
        return out

    # -- in-run evaluation ----------------------------------------------------------------------
    def _hold_out(self, smp: Sample, key: str) -> bool:
        """Keep the first ``eval_samples`` samples for evaluation; True if ``smp`` is not to be trained on."""
        cfg = self.cfg
        if cfg.eval_every <= 0:
            return False
        dg = token_digest(smp.token_ids)
        if dg in self.heldout_digests:  # a held-out sample again (next epoch): training on it would leak
            self.heldout_repeats += 1
            return True
        if len(self.heldout) >= cfg.eval_samples or smp.token_ids.shape[0] < 2:
            return False
        f = features(smp, self.aux_layer_ids)  # copied: the stream may hand its buffers back
        self.heldout.append(Features(key, f.input_ids.clone(), f.aux.clone(), f.last.clone(), f.loss_mask.clone()))
        self.heldout_digests.add(dg)
        return True

    def evaluate(self, stream=None) -> dict:  # noqa: ANN001
        """Top-1 per TTT step on the held-out samples (token-weighted), without a gradient.

        Heartbeats go out before, between samples and after, as around a checkpoint, so the
        stream's leases do not lapse however long the evaluation takes.
        """
        assert self.model is not None
        keepalive = getattr(stream, "keepalive", None)
        k = self.cfg.ttt_steps
        sums, tots, loss_sum = [0.0] * k, [0.0] * k, 0.0
        t0 = time.perf_counter()
        self.model.eval()
        try:
            with torch.no_grad():
                for f in self.heldout:
                    if keepalive:
                        keepalive()
                    _, loss, metrics = self.model(
                        **pack([f]), ttt_steps=k, ttt_step_loss_decay=self.cfg.ttt_step_loss_decay,
                        loss_config=self.loss_config,
                    )  # fmt: skip
                    loss_sum += float(loss)
                    for i in range(k):
                        sums[i] += float(metrics[f"full_acc_{i}_sum"])
                        tots[i] += float(metrics[f"full_acc_{i}_total"])
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
                 "/".join(f"{e[f'eval_top1_{i}']:.3f}" for i in range(self.cfg.ttt_steps)), len(self.heldout),
                 e["eval_s"])  # fmt: skip
        if self._tb is not None:
            for k, v in e.items():
                if k.startswith("eval_") and k != "eval_samples":
                    self._tb.add_scalar(f"eval/{k.removeprefix('eval_')}", v, self.step)
        return e

    # -- checkpoint + ack ---------------------------------------------------------------------
    def _checkpoint(self, stream, pending: list[P.SampleKey], trained_pending: list[str]) -> Path:  # noqa: ANN001
        assert self.model is not None and self.optimizer is not None and self.scheduler is not None
        state = {
            "step": self.step,
            "samples_trained": self.samples_trained,
            "tokens_trained": self.tokens_trained,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "aux_layer_ids": self.aux_layer_ids,
            "draft_vocab_size": self.draft_vocab_size,
            # Included in these weights, not yet acknowledged when they were written.
            "unacked_keys": sorted(set(trained_pending) | self.skip_keys),
            "heldout_digests": sorted(self.heldout_digests),
            "time": time.time(),
        }
        keepalive = getattr(stream, "keepalive", None)  # leases must not lapse while we write
        if keepalive:
            keepalive()
        path = M.save_checkpoint(self.out, self.step, self.model, state, keep=self.cfg.keep_checkpoints)
        if keepalive:
            keepalive()
        if pending and hasattr(stream, "ack_through"):
            stream.ack_through(pending[-1])
        return path

    # -- loop ---------------------------------------------------------------------------------
    def train(self, stream: Iterable[Sample]) -> TrainResult:
        """Train until the stream ends or ``max_steps``; checkpoints, acks, logs on the way."""
        cfg = self.cfg
        self.prepare()
        it: Iterator[Sample] = iter(stream)
        t_start = time.perf_counter()
        wait_s = 0.0
        pending: list[P.SampleKey] = []  # yielded since the last ack, in order
        trained_pending: list[str] = []  # of those, the ones trained (or skipped as already in the weights)
        history: list[dict] = []
        skipped = 0
        donor: Features | None = None
        last_ckpt: Path | None = None
        exhausted = False
        bar = None
        keys_log = None
        metrics_log = None
        run_samples = run_tokens = 0
        last_eval: dict | None = None
        origin = cfg.clock_origin if cfg.clock_origin is not None else time.time()
        every_s = cfg.checkpoint_every_s
        next_due_s = (math.floor((time.time() - origin) / every_s) + 1) * every_s if every_s else math.inf
        try:
            while True:
                if cfg.max_steps is not None and self.step >= cfg.max_steps:
                    break
                t0 = time.perf_counter()
                items: list[Features] = []
                ntok = 0
                while len(items) < cfg.samples_per_step and ntok < cfg.max_tokens_per_step:
                    try:
                        smp = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    self.check(smp)
                    if keys_log is None:
                        keys_log = open(self.out / KEYS_LOG, "a", buffering=1)  # noqa: SIM115
                        metrics_log = open(self.out / METRICS_LOG, "a", buffering=1)  # noqa: SIM115
                        if cfg.progress:
                            from tqdm import tqdm

                            bar = tqdm(total=cfg.max_steps, initial=self.step, desc="eagle3", unit="step",
                                       dynamic_ncols=True)  # fmt: skip
                    pending.append(smp.key)
                    key = str(smp.key)
                    if key in self.skip_keys:  # already in the weights; only its ack may have been lost
                        skipped += 1
                        trained_pending.append(key)
                        continue
                    if self._hold_out(smp, key):  # used (acknowledged with the next checkpoint), not trained
                        trained_pending.append(key)
                        continue
                    f = features(smp, self.aux_layer_ids)
                    if cfg.control == "swap-hidden":
                        prev, donor = donor, f
                        if prev is None:  # the first sample only donates
                            trained_pending.append(key)
                            continue
                        f = swap_aux(f, prev)
                    items.append(f)
                    ntok += f.num_tokens
                wait_s += time.perf_counter() - t0
                if items:
                    m = self.train_step(items)
                    self.samples_trained += len(items)
                    self.tokens_trained += sum(x.num_tokens for x in items)
                    run_samples += len(items)
                    run_tokens += sum(x.num_tokens for x in items)
                    keys = [x.key for x in items]
                    trained_pending.extend(keys)
                    elapsed = time.perf_counter() - t_start
                    m.update(samples_per_s=run_samples / elapsed, wait_frac=wait_s / elapsed, samples=self.samples_trained)
                    history.append(m)
                    assert keys_log is not None and metrics_log is not None
                    keys_log.write(json.dumps({"step": self.step, "keys": keys, "pid": os.getpid()}) + "\n")
                    if self.step % cfg.log_every == 0 or self.step == 1:
                        metrics_log.write(json.dumps(m) + "\n")
                        log.info(
                            "step %d loss %.4f top1 %s lr %.2e %.1f samples/s wait %.0f%%", self.step, m["loss"],
                            "/".join(f"{m[f'top1_{i}']:.2f}" for i in range(cfg.ttt_steps)), m["lr"],
                            m["samples_per_s"], 100 * m["wait_frac"],
                        )  # fmt: skip
                        if self._tb is not None:
                            for k, v in m.items():
                                if k != "step":
                                    self._tb.add_scalar(f"train/{k}", v, self.step)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{m['loss']:.3f}", top1=f"{m['top1_0']:.2f}",
                                        sps=f"{m['samples_per_s']:.1f}", wait=f"{m['wait_frac']:.0%}")  # fmt: skip
                if items and cfg.eval_every > 0 and self.heldout and self.step % cfg.eval_every == 0:
                    last_eval = self._eval_and_log(stream, metrics_log, history)
                due = items and self.step % cfg.checkpoint_every == 0
                if items and time.time() - origin >= next_due_s:
                    due = True
                    next_due_s = (math.floor((time.time() - origin) / every_s) + 1) * every_s
                at_end = exhausted or (cfg.max_steps is not None and self.step >= cfg.max_steps)
                drained = bool(pending) and not at_end and self.drained is not None and self.drained(len(pending))
                if pending and (due or at_end or drained):
                    last_ckpt = self._checkpoint(stream, pending, trained_pending)
                    self.skip_keys -= set(trained_pending)
                    pending, trained_pending = [], []
                if exhausted:
                    break
            if cfg.eval_every > 0 and self.heldout and (last_eval is None or last_eval["step"] != self.step):
                last_eval = self._eval_and_log(stream, metrics_log, history)  # the final weights' figure
            if keys_log is None:  # not a single sample came
                if self.resumed_from is None:
                    raise RuntimeError("the stream ended before delivering any sample: nothing to train on")
                # resumed after the jobs were complete: the newest checkpoint is the result
                return self._result(history, 0, 0, 0, time.perf_counter() - t_start, wait_s, self.resumed_from, last_eval)
            if last_ckpt is None or pending or int(last_ckpt.name.removeprefix("step-")) != self.step:
                last_ckpt = self._checkpoint(stream, pending, trained_pending)
        finally:
            if bar is not None:
                bar.close()
            for fh in (keys_log, metrics_log):
                if fh is not None:
                    fh.close()
            if self._tb is not None:
                self._tb.flush()
        return self._result(history, run_samples, run_tokens, skipped, time.perf_counter() - t_start, wait_s, last_ckpt,
                            last_eval)  # fmt: skip

    def _result(self, history, samples, tokens, skipped, wall, wait, ckpt, last_eval=None, window: int = 50) -> TrainResult:  # noqa: ANN001
        k = self.cfg.ttt_steps
        tail = [h for h in history if "loss" in h][-window:]
        top1 = []
        for i in range(k):
            n = sum(h[f"n_{i}"] for h in tail)
            top1.append(sum(h[f"top1_{i}"] * h[f"n_{i}"] for h in tail) / n if n else 0.0)
        loss = sum(h["loss"] for h in tail) / len(tail) if tail else float("nan")
        return TrainResult(
            steps=self.step, samples=samples, tokens=tokens, skipped_already_trained=skipped, wall_s=round(wall, 2),
            wait_s=round(wait, 2), final_checkpoint=str(ckpt) if ckpt else None,
            draft_dir=str(ckpt / M.DRAFT_DIR) if ckpt else None, top1=top1, loss=loss, window=len(tail),
            history=history,
            eval_top1=[last_eval[f"eval_top1_{i}"] for i in range(k)] if last_eval else None,
            held_out=len(self.heldout),
        )  # fmt: skip
