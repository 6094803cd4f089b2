"""The trainer's settings and result, and which device and precision a run uses.

Precision follows speculators 0.9's Eagle-3 trainer (``speculators/train/trainer.py``): the
draft keeps float32 weights (the master copy the optimizer updates) and on an accelerator the
forward runs under ``torch.autocast(dtype=bfloat16)`` with the hidden states fed as bf16, as
they arrive from vLLM. On CPU nothing is autocast: float32 throughout, as before.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class TrainConfig:
    verifier: str
    out_dir: str
    # Which draft to train: a name in trainer_client.drafts.REGISTRY (eagle3, peagle, dflash, dspark).
    draft: str = "eagle3"
    aux_layer_ids: list[int] | None = None  # None: the draft's default (Eagle-3's usual [2, N//2, N-3])
    draft_vocab_size: int | None = None  # None: min(32000, verifier vocabulary)
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
    # With several ranks, rank 0 holds out and evaluates.
    eval_every: int = 0
    eval_samples: int = 8
    # Or exactly these samples, by their id (the job's sample "id", ``Sample.label``), whenever
    # they come: runs that get the same samples in different orders then hold out the same ones.
    eval_ids: tuple[str, ...] | None = None
    # Or a share of every job, drawn by connector/contract/holdout.py from each sample's id (else
    # its index) and ``eval_seed``: never trained on, on any rank or epoch, whether or not
    # ``eval_every`` evaluates in-run (the first ``eval_samples`` of them); ``hsstream eval --job
    # ID --eval-fraction F --eval-seed S`` measures served acceptance on exactly these.
    eval_fraction: float = 0.0
    eval_seed: int = 0
    log_every: int = 10
    seed: int = 0
    control: str = "none"  # "swap-hidden": negative control, aux states from another sample
    tensorboard: bool = True  # with logger None: TensorBoard if its package is installed
    # "tensorboard", "wandb", comma-separated, or "none"; a named one must be installed (loggers.py)
    logger: str | None = None
    progress: bool = True
    threads: int | None = None
    # "auto": cuda if available else cpu; "cpu", "cuda", "cuda:N". Under torchrun every rank
    # takes cuda:LOCAL_RANK for "auto"/"cuda".
    device: str = "auto"
    # "auto": bf16 autocast on CUDA (speculators' choice), none on CPU; or "bf16", "none".
    autocast: str = "auto"
    # Batches fetched and copied to the device ahead of the step: None = 1 on CUDA, 0 on CPU
    # (on CPU the step and the fetch share the cores; nothing would overlap).
    prefetch: int | None = None
    # The stream yields None after this long without a sample, so the loop can checkpoint at a
    # job's tail and ranks keep joining collectives (HiddenStateStream(idle_s=...)).
    idle_s: float = 0.2
    # The draft's own settings by name (ttt_steps, mask_token_id, block_size, ...): each draft
    # declares them in its plug-in (``Draft.Options``, trainer_client/drafts/) and reads them back
    # typed; a setting another draft takes is ignored with a warning.
    draft_options: dict[str, Any] = field(default_factory=dict)
    # Warm start (trainer_client/train/warm_start.py): a trained draft dir (the serving one) whose
    # weights, aux layers and vocabulary the run starts from, instead of a fresh draft.
    init_draft: str | None = None
    extra: dict = field(default_factory=dict)  # recorded in run.json (job ids, command line, ...)


@dataclass
class TrainResult:
    steps: int
    samples: int  # all ranks
    tokens: int  # all ranks
    skipped_already_trained: int
    wall_s: float
    wait_s: float  # this rank: time the device had no step because no batch was ready
    final_checkpoint: str | None
    draft_dir: str | None
    top1: list[float]  # per draft position (Eagle-3: TTT step), token-weighted over the last ``window`` steps
    loss: float
    window: int
    device: str = "cpu"
    autocast: str | None = None
    world_size: int = 1
    ranks: list[dict] = field(default_factory=list)  # per rank: samples, tokens, wait_s
    history: list[dict] = field(default_factory=list, repr=False)
    eval_top1: list[float] | None = None  # the last held-out evaluation (``eval_every``)
    held_out: int = 0  # samples held out for it (their repeats in later epochs are not trained either)
    held_out_by_fraction: int = 0  # this rank: samples not trained on by ``eval_fraction`` (every epoch)
    final_dir: str | None = None  # OUT/final: the last checkpoint's draft, kept whatever rotation does
    serve: str | None = None  # the `vllm serve` line that serves the verifier with final_dir
    draft: str = "eagle3"
    speculative_config: dict | None = None  # what vLLM's --speculative-config takes for final_dir
    skipped_no_loss: int = 0  # this rank: samples with no loss-carrying position, acknowledged untrained
    serve_refused: str | None = None  # why the installed vLLM would not serve final_dir (then no serve line)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("history")
        return d


class DeviceError(ValueError):
    """The device asked for cannot be used (no CUDA, a fixed GPU for several ranks)."""


def resolve_device(spec: str, *, local_rank: int | None = None, world_size: int = 1) -> torch.device:
    """``TrainConfig.device`` → a torch device; under torchrun ``auto``/``cuda`` is cuda:LOCAL_RANK."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if not spec.startswith("cuda"):
        raise DeviceError(f"device {spec!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r} asked for, but torch sees no CUDA device (torch {torch.__version__})")
    if spec == "cuda":
        idx = local_rank if local_rank is not None else 0
    else:
        if world_size > 1:
            raise DeviceError(f"device {spec!r} with {world_size} ranks: pass --device cuda, rank r uses cuda:LOCAL_RANK")
        idx = int(spec.split(":", 1)[1])
    if idx >= torch.cuda.device_count():
        raise DeviceError(f"cuda:{idx} asked for, {torch.cuda.device_count()} visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")  # fmt: skip
    return torch.device("cuda", idx)


def resolve_autocast(spec: str, device: torch.device) -> torch.dtype | None:
    spec = (spec or "auto").lower()
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if spec == "bf16":
        return torch.bfloat16
    if spec == "none":
        return None
    raise ValueError(f"autocast {spec!r}: use auto, bf16 or none")
