"""Where the trainer's scalars go besides ``OUT/metrics.jsonl``: TensorBoard, Weights & Biases.

``TrainConfig.logger`` names them, comma-separated, as speculators' ``--logger`` does
(``tensorboard``, ``wandb``, or ``none``). Named, a logger whose package is missing is an error
before anything is trained: a run asked to log somewhere must not train for hours logging
nowhere. Unnamed (``None``), the trainer keeps its old habit: TensorBoard if the package is
there and ``TrainConfig.tensorboard`` is on, else nothing.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from dataclasses import asdict
from pathlib import Path

from trainer_client.train.config import TrainConfig

#: logger name → the package it needs (what ``pip install`` takes).
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
#: speculators' loggers this trainer has no writer for.
NOT_HERE = ("trackio", "mlflow")
WANDB_ID_FILE = "wandb_run_id"


class LoggerError(ValueError):
    """A logger that is unknown or whose package is not installed."""


def names(spec: str | None, *, tensorboard: bool = True) -> list[str]:
    """The loggers ``spec`` asks for; with ``spec`` None, TensorBoard only if installed."""
    if spec is None:
        return ["tensorboard"] if tensorboard and _installed("tensorboard") else []
    out: list[str] = []
    for n in (x.strip().lower() for x in spec.split(",")):
        if n in ("", "none"):
            continue
        if n in NOT_HERE:
            raise LoggerError(f"logger {n!r}: speculators has it, hsstream train does not (use {', '.join(PACKAGES)})")
        if n not in PACKAGES:
            raise LoggerError(f"logger {n!r}: use {', '.join(PACKAGES)} or none (comma-separated)")
        if not _installed(PACKAGES[n]):
            raise LoggerError(f"logger {n!r} asked for, but its package is not installed: pip install {PACKAGES[n]}")
        if n not in out:
            out.append(n)
    return out


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


class MetricLoggers:
    """Fan-out of ``log(scalars, step)`` to the chosen loggers (rank 0 only)."""

    def __init__(self, which: list[str], out: Path, cfg: TrainConfig) -> None:
        self.which = list(which)
        self._tb = None
        self._wandb = None
        if "tensorboard" in which:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out / "tensorboard"))
        if "wandb" in which:
            try:
                import wandb
            except ImportError as e:  # checked by choose(), but an install can break between
                raise LoggerError(f"logger 'wandb': {e}: pip install 'hidden-state-stream[loggers]'") from e

            # one W&B run per run dir: a resumed run continues the same one
            id_file = out / WANDB_ID_FILE
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
            self._wandb = wandb.init(id=run_id, resume="allow", dir=str(out),
                                     name=os.path.basename(os.path.abspath(out)),
                                     config={k: v for k, v in asdict(cfg).items() if k != "extra"})

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(dict(scalars), step=step)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
