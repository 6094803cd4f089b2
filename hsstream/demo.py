"""``make demo``: the whole loop on this machine, with the embedded tiny verifier.

Builds the tiny model, starts vLLM (with our connector) and the sidecar as real processes,
submits prompts over REST, consumes them with ``HiddenStateStream`` and prints what flowed.
It exits non-zero if anything is lost or left behind in the spool.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
import time
from pathlib import Path

from rich.console import Console

from connector.contract.rest_client import SidecarClient
from hsstream import launch
from hsstream.up import Supervisor, UpConfig, hsstream_vllm_cli

console = Console(stderr=True)

_WORDS = (
    "the model reads a prompt and writes hidden states into shared memory while a trainer "
    "learns to draft tokens faster streaming tensors over sockets without touching disk"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports (engines listen on port, port + 1, ...)."""
    if n == 1:
        return free_port()
    for _ in range(100):
        first = free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", first + i))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def demo_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append({"id": f"chat-{i}", "messages": [
                {"role": "user", "content": " ".join(rng.choices(_WORDS, k=rng.randint(5, 20)))},
                {"role": "assistant", "content": " ".join(rng.choices(_WORDS, k=rng.randint(5, 30)))},
            ]})  # fmt: skip
        else:
            out.append({"id": f"prompt-{i}", "prompt": " ".join(rng.choices(_WORDS, k=rng.randint(8, 60)))})
    return out


class Stack:
    """vLLM + sidecar as child processes, stopped together, spool removed.

    A thin front over :class:`hsstream.up.Supervisor` (what ``hsstream up`` runs), so the demo
    and the tests start the stack exactly as users do; this class only picks private paths and
    free ports. ``env`` may be changed before :meth:`start`; ``children`` may be replaced by
    tests that kill and restart a process themselves (``stop`` stops whatever is listed).
    """

    def __init__(
        self, model: str, layer_ids: list[int], workdir: Path, *, prefix_caching: bool = False,
        max_model_len: int = 1024, gpu_memory_utilization: float | None = None, vllm_extra: list[str] | None = None,
        vllm_gpus: str | None = None, engines: int = 1,
    ) -> None:  # fmt: skip
        self.model = model
        self.layer_ids = layer_ids
        self.workdir = workdir
        self.spool = Path(tempfile.mkdtemp(prefix="hsstream-", dir="/dev/shm"))
        self.run_dir = Path(tempfile.mkdtemp(prefix="hsstream-run-"))
        self.engines = engines
        self.vllm_port, self.api_port = free_ports(engines), free_port()
        self.env = {
            "HSSTREAM_SPOOL_DIR": str(self.spool),
            "HSSTREAM_RUN_DIR": str(self.run_dir),
            "HSSTREAM_VLLM_URL": ",".join(f"http://127.0.0.1:{self.vllm_port + i}" for i in range(engines)),
            "HSSTREAM_MODEL": model,
            "HSSTREAM_LAYER_IDS": ",".join(map(str, layer_ids)),
            "HSSTREAM_PORT": str(self.api_port),
            "PYTHONUNBUFFERED": "1",
        }
        self.prefix_caching = prefix_caching
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.vllm_extra = list(vllm_extra or [])  # more vLLM flags (benchmarks: --load-format dummy, TP)
        self.vllm_gpus = vllm_gpus  # CUDA_VISIBLE_DEVICES of vLLM
        self.children: list[launch.Child] = []
        self._sup: Supervisor | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def delivery_endpoint(self) -> str:
        return f"ipc://{self.run_dir}/delivery.sock"

    def start(self, on_tick=None) -> None:  # noqa: ANN001
        cli = hsstream_vllm_cli(
            self.model, self.layer_ids, "127.0.0.1", self.vllm_port, max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization or (0.2 if launch.is_cpu_build() else None),
            enforce_eager=True, prefix_caching=self.prefix_caching,
            extra=["--served-model-name", "verifier", *self.vllm_extra],
        )  # fmt: skip
        cfg = UpConfig(
            model=self.model, layer_ids=self.layer_ids, spool_dir=self.spool, run_dir=self.run_dir,
            api_host="127.0.0.1", api_port=self.api_port, vllm_host="127.0.0.1", vllm_port=self.vllm_port,
            vllm_cli=cli, env=self.env, max_restarts=0, ready_timeout_s=600, log_dir=self.workdir,
            cwd=launch.repo_root(), vllm_gpus=self.vllm_gpus, engines=self.engines,
        )  # fmt: skip
        self._sup = Supervisor(cfg, echo=False)
        self._sup.children = self.children
        self._sup.start(on_tick)

    def stop(self) -> None:
        if self._sup is not None:
            self._sup.stop()
        for c in self.children:  # never started through the supervisor, or added later
            c.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def spool_files(self) -> list[str]:
        """Everything in the spool but the sidecar's ownership marker."""
        from connector.protocol import SPOOL_MARKER

        return sorted(n for n in os.listdir(self.spool) if n != SPOOL_MARKER) if self.spool.exists() else []

    def remove_spool(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)


def run_demo(num_prompts: int = 32, workdir: str | None = None) -> int:
    from hsstream.tiny_model import build_tiny_verifier
    from trainer_client import HiddenStateStream

    t_all = time.perf_counter()
    with console.status("building the tiny verifier (cached after the first run)"):
        model = str(build_tiny_verifier())
    n = launch.num_hidden_layers(model)
    assert n is not None
    layer_ids = launch.default_layer_ids(n)
    wd = Path(workdir or tempfile.mkdtemp(prefix="hsstream-demo-"))
    wd.mkdir(parents=True, exist_ok=True)
    stack = Stack(model, layer_ids, wd)
    bind = launch.cpu_env().get("VLLM_CPU_OMP_THREADS_BIND", "n/a") if launch.is_cpu_build() else "cuda"
    console.print(f"model {model} ({n} layers), layers {layer_ids}, spool {stack.spool}, logs {wd}")
    try:
        with console.status("starting vLLM + sidecar") as st:
            stack.start(on_tick=lambda s: st.update(f"starting vLLM (CPU build, threads bound {bind}): {s:.0f} s"))
        console.print(f"stack ready after {time.perf_counter() - t_all:.0f} s")
        with SidecarClient(stack.api) as api:
            job = api.create_job(demo_prompts(num_prompts)).job_id
        t0 = time.perf_counter()
        tokens = nbytes = samples = 0
        with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=300) as stream:
            for smp in stream:
                samples += 1
                tokens += int(smp.token_ids.shape[0])
                nbytes += smp.hidden_states.numel() * smp.hidden_states.element_size()
                console.print(
                    f"  {samples:3d}/{num_prompts} {smp.label:>10s} {tuple(smp.hidden_states.shape)} "
                    f"{smp.hidden_states.dtype} loss-mask {int(smp.loss_mask.sum()) if smp.loss_mask is not None else '-'}",
                    highlight=False,
                )
        dt = time.perf_counter() - t0
        with SidecarClient(stack.api, timeout=10) as api:
            status = api.job(job)
        time.sleep(0.2)
        left = stack.spool_files()
        print(
            f"\nsamples {samples}  tokens {tokens}  tokens/s {tokens / dt:,.0f}  bytes {nbytes:,}  "
            f"stream wall {dt:.1f} s  total wall {time.perf_counter() - t_all:.1f} s  "
            f"CPU thread binding {bind}\njob {job}: {status.counts}  spool files left: {len(left)}"
        )
        ok = samples == num_prompts and status.counts["consumed"] == num_prompts and not left
        if not ok:
            console.print("[red]demo FAILED: samples missing or files left in the spool[/red]")
        return 0 if ok else 1
    except Exception as e:  # noqa: BLE001
        console.print(f"[red]demo failed: {e}[/red]")
        return 1
    finally:
        stack.stop()
        stack.remove_spool()
