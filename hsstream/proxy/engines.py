"""Serving engines the proxy starts itself (managed mode): one vLLM per draft version.

A blue/green swap needs a second engine with the new draft beside the live one until the
switch: :meth:`EngineManager.start` launches it on a free loopback port (the command line from
``hsstream.launch.vllm_args``, as every vLLM here), waits until it answers, and hands back its
URL; :meth:`stop` stops it (its whole process group) once the proxy drained it. On the CPU
build both engines get the same cores (``VLLM_CPU_OMP_THREADS_BIND`` of the proxy's
environment, else every core the process may use): the green one only loads while the blue
one serves, so they never compute at once for long.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from hsstream import launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EngineManager:
    model: str
    log_dir: Path
    max_model_len: int | None = 1024
    gpu_memory_utilization: float | None = None
    num_speculative_tokens: int | None = None
    served_model_name: str | None = None
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 900.0
    #: ``--weight-transfer-config`` for in-place draft updates (``weight_swap.py``); None: off.
    weight_transfer: dict | None = None
    _n: int = 0

    def command(self, draft: str | None, port: int) -> list[str]:
        import json

        extra = list(self.extra)
        if self.weight_transfer is not None:
            extra += ["--weight-transfer-config", json.dumps(self.weight_transfer)]
        opts = launch.VllmOptions(
            model=self.model, layer_ids=[], spool_dir="", notice_endpoint="", port=port, host="127.0.0.1",
            max_model_len=self.max_model_len, enforce_eager=launch.is_cpu_build(), extraction=False, draft=draft,
            gpu_memory_utilization=self.gpu_memory_utilization or (0.2 if launch.is_cpu_build() else None),
            num_speculative_tokens=self.num_speculative_tokens, served_model_name=self.served_model_name, extra=extra,
        )  # fmt: skip
        return launch.vllm_args(opts)

    def start(self, draft: str | None, version: str) -> tuple[str, launch.Child]:
        """Start an engine serving ``draft`` and wait until it answers; (url, child)."""
        self._n += 1
        port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"engine-{self._n}-{_safe(version)}.log"
        env = launch.child_env(self.env)
        if self.weight_transfer is not None:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # the weight-update routes; the engine binds loopback only
        child = launch.spawn(f"vllm-{version}", self.command(draft, port), env, log_path=log, cwd=launch.repo_root())
        url = f"http://127.0.0.1:{port}"
        try:
            launch.wait_http(f"{url}/health", child, self.ready_timeout_s)
            launch.wait_http(f"{url}/v1/models", child, 60)
        except BaseException:
            child.stop()
            raise
        return url, child

    @staticmethod
    def stop(child: launch.Child, timeout_s: float = 30.0) -> int | None:
        return child.stop(timeout_s)


def _safe(version: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in version)[:60] or "v"


def wait_until(pred, timeout_s: float, every_s: float = 0.2) -> bool:  # noqa: ANN001
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return True
        time.sleep(every_s)
    return bool(pred())
