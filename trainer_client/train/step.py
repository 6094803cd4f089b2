"""One optimizer step of the draft: forward (the draft plug-in's loss), backward, update.

Split in two so the host can do the data path while the device computes: :meth:`DraftStep.launch`
queues the step (on CUDA everything up to the optimizer update is asynchronous) and
:meth:`DraftStep.finish` waits for it and reads the metrics with one device→host copy.

Several ranks: the loss of each rank is weighted by its share of the step's loss-carrying
tokens (``n_r / N``, N over all ranks) and the gradients are *summed* over ranks, so the
update is the gradient of the token-weighted mean over every rank's tokens, whatever each rank
got from the stream. A rank with no batch this step contributes zeros and still applies the
same update, so the weights stay identical on every rank without a per-step broadcast. (That
is also why this is not ``DistributedDataParallel``: a rank without a sample would have to
fake a forward to join its reducer.) The step's metrics ride in the same all-reduce.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from trainer_client.train.config import TrainConfig
from trainer_client.train.data_path import CudaOps
from trainer_client.train.distributed import World


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


@dataclass
class Launched:
    stats: torch.Tensor  # [loss, grad_norm, loss_tokens, (acc_sum_i, acc_total_i) * k], on the device
    lr: float
    t0: float  # host time the launch began
    timers: tuple | None  # CUDA: (start, end) events around the step's device work


class DraftStep:
    """Owns the draft's optimizer and schedule; runs steps on ``device``."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device, world: World,
                 autocast: torch.dtype | None, ops: CudaOps | None, draft) -> None:  # noqa: ANN001  # fmt: skip
        self.model, self.cfg, self.device, self.world, self.ops = model, cfg, device, world, ops
        self.draft = draft
        self.k = int(draft.positions())
        self.autocast = autocast
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.step = 0

    def _autocast(self):  # noqa: ANN202
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def launch(self, batch: dict[str, torch.Tensor] | None, loss_tokens: int = 0, global_loss_tokens: int = 0) -> Launched:
        """Queue one step. ``batch`` None: this rank has nothing this step (several ranks only)."""
        k = self.k
        t0 = time.perf_counter()
        timers = (self.ops.timer(),) if self.ops is not None else None
        self.model.train()
        stats = torch.zeros(3 + 2 * k, dtype=torch.float32, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        if batch is not None:
            with self._autocast():
                loss, correct, counted = self.draft.forward(self.model, batch)
            if self.world.distributed:  # this rank's share of the step's loss tokens
                loss = loss * (loss_tokens / max(1, global_loss_tokens))
            loss.backward()
            stats[0] = loss.detach().float()
            stats[2] = batch["loss_mask"].sum()
            for i in range(k):
                stats[3 + 2 * i] = torch.as_tensor(correct[i]).float()
                stats[4 + 2 * i] = torch.as_tensor(counted[i]).float()
        elif not self.world.distributed:
            raise ValueError("a step without a batch only makes sense with several ranks")
        if self.world.distributed:
            self._all_reduce(stats)
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        stats[1] = gnorm.detach().float()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        if timers is not None:
            timers = (timers[0], self.ops.timer())
        return Launched(stats, self.scheduler.get_last_lr()[0], t0, timers)

    def _all_reduce(self, stats: torch.Tensor) -> None:
        """Gradients and metrics summed over ranks, in one all-reduce of one flat buffer."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [stats])
        self.world.all_reduce_(flat)
        o = 0
        for p, g in zip(self.params, grads, strict=True):
            n = g.numel()
            p.grad = flat[o : o + n].view_as(p).to(p.dtype)
            o += n
        stats.copy_(flat[o:])

    def finish(self, h: Launched) -> tuple[dict, float]:
        """Wait for the step; its metrics (all ranks') and the device time it took."""
        vals = h.stats.tolist()  # one device→host copy: the host waits for the step here
        if h.timers is not None and self.ops is not None:
            device_s = self.ops.elapsed_s(*h.timers)
        else:
            device_s = time.perf_counter() - h.t0
        k = self.k
        out = {"step": self.step, "loss": vals[0], "grad_norm": vals[1], "lr": h.lr, "tokens": int(vals[2])}
        for i in range(k):
            tot = vals[4 + 2 * i]
            out[f"top1_{i}"] = vals[3 + 2 * i] / tot if tot else 0.0
            out[f"n_{i}"] = tot
        return out, device_s
