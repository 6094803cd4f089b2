"""speculators' own trainer (``speculators train``), run on the CPU: its ``main`` and its
``Trainer`` class, unmodified, with the device set.

``speculators train`` cannot run on a machine without an accelerator (speculators 0.9.0, found
by running it on this machine's CPU):

1. ``Trainer.__init__`` takes ``self.local_rank = get_local_rank()`` (0) and
   ``self.device_type = "cuda"`` when ``torch.accelerator.current_accelerator()`` is None, then
   ``setup_model`` calls ``self.model.to(self.local_rank)``: RuntimeError "Cannot access
   accelerator device when none is available".
2. With the device set, the first step's ``_StepTimer.mark`` (enabled on every logged step, and
   step 0 is always logged) calls ``torch.accelerator.synchronize()``: the same RuntimeError.

So this driver (the preferred fallback of issue 39: "its trainer class driven from Python with
the device set") runs ``speculators.train.cli.main`` itself, with two changes made from outside,
in this process only, and nothing in speculators' files:

* ``cli.Trainer`` is a subclass whose ``setup_model`` first sets ``local_rank`` and
  ``device_type`` to the CPU (every ``.to(self.local_rank)`` and ``torch.autocast(self.
  device_type, ...)`` then means the CPU), then runs speculators' own ``setup_model``;
* ``torch.accelerator.synchronize`` is a no-op when torch has no accelerator (CPU work is
  synchronous: there is nothing to wait for).

The argument list is ``speculators train``'s own (``TrainConfig.resolve``). Writes
``--report FILE`` (what was changed and what ran) before training starts.

    python bench/vs_speculators/spec_train.py --report R.json -- --verifier-name-or-path ... (speculators train's flags)
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    report = None
    if argv[:1] == ["--report"]:
        report, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    import torch
    from speculators.train import cli
    from speculators.train import trainer as T
    from speculators.train.config import TrainConfig

    cpu = torch.device("cpu")
    shims = []

    class CpuTrainer(T.Trainer):
        """speculators' Trainer with its device set to the CPU (see the module docstring)."""

        def setup_model(self) -> None:
            self.local_rank = cpu
            self.device_type = "cpu"
            super().setup_model()

    cli.Trainer = CpuTrainer
    shims.append("speculators.train.cli.Trainer -> subclass setting local_rank=cpu, device_type='cpu' before setup_model")
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None  # noqa: ARG005
        shims.append("torch.accelerator.synchronize -> no-op (no accelerator)")
    cfg = TrainConfig.resolve(argv)
    if report:
        from importlib.metadata import version

        with open(report, "w") as f:
            json.dump({"shims": shims, "argv": argv, "speculators": version("speculators"), "torch": torch.__version__, "pid": os.getpid(), "started": time.time(),
                       "cpus": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
                       "config": cfg.flatten()}, f, default=str)  # fmt: skip
    cli.main(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
