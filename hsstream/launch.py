"""Starting the stack's processes: the one place that builds vLLM's command line.

``hsstream vllm`` (what compose runs), ``hsstream up``, the demo, the tests and the
benchmarks all get the vLLM arguments from :func:`vllm_args`, so the connector's module path,
the extraction config and the layer-id checks cannot drift apart between them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from connector.layers import default_layer_ids, validate_layer_ids  # noqa: F401 - default_layer_ids: the CLI's

CONNECTOR_CLASS = "HiddenStatesStreamConnector"
CONNECTOR_MODULE = "connector.vllm_plugin"


def num_hidden_layers(model_dir: str) -> int | None:
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    c = json.loads(cfg.read_text())
    c = c.get("text_config", c)
    return int(c["num_hidden_layers"])


#: CPU flags with bf16 arithmetic in hardware (AVX512-BF16, AMX). Without them PyTorch's and
#: vLLM's CPU kernels emulate bf16, tens of times slower than float32 (bench/costs/cpu_dtype.py).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
HALF_DTYPES = ("bfloat16", "float16")
#: Overrides the choice below for every vLLM we start: a vLLM ``--dtype`` value, or ``auto``.
DTYPE_ENV = "HSSTREAM_VLLM_DTYPE"


def model_dtype(model_dir: str) -> str | None:
    """The checkpoint's own dtype (``torch_dtype``/``dtype`` of its config.json), if it says."""
    cfg = Path(model_dir) / "config.json"
    try:
        c = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    c = c.get("text_config", c) if isinstance(c.get("text_config"), dict) and not c.get("torch_dtype") else c
    d = c.get("torch_dtype") or c.get("dtype")
    return str(d) if d else None


def cpu_serving_dtype(model_dir: str, extra: list[str] | tuple[str, ...] = (), *, cpu: bool | None = None,
                      flags: set[str] | None = None) -> str | None:  # fmt: skip
    """``"float32"`` where vLLM's CPU build would otherwise serve a half-precision checkpoint on a
    CPU without bf16 instructions (tens of times slower: see ``BF16_FLAGS``), else None (vLLM's
    own choice stands). A ``--dtype`` the user passed always wins, then ``HSSTREAM_VLLM_DTYPE``
    (a vLLM dtype, or ``auto`` for vLLM's own choice: the test suite's setting, whose references
    are computed in the checkpoint's dtype)."""
    if any(x == "--dtype" or x.startswith("--dtype=") for x in extra):
        return None
    if env := os.environ.get(DTYPE_ENV, "").strip():
        return None if env == "auto" else env
    if not (is_cpu_build() if cpu is None else cpu):
        return None
    if model_dtype(model_dir) not in HALF_DTYPES:
        return None
    from hsstream.amx import cpu_flags

    have = cpu_flags() if flags is None else flags
    return None if any(f in have for f in BF16_FLAGS) else "float32"


@dataclass
class VllmOptions:
    model: str
    layer_ids: list[int]
    spool_dir: str
    notice_endpoint: str
    port: int = 8000
    host: str = "127.0.0.1"
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    prefix_caching: bool = False
    num_writer_threads: int = 4
    layer_order: str = "config"  # or "sorted": see connector/contract/settings.py
    served_model_name: str | None = None
    #: vLLM's --shutdown-timeout. Its default, 0, force-kills the engine at once on SIGTERM,
    #: before it unlinks its shared memory ("leaked shared_memory" warnings, RAM held in
    #: /dev/shm); with a few seconds it drains and tears down in order (~5 s on CPU).
    shutdown_timeout_s: int = 15
    #: False: plain vLLM (no extraction method, no connector), the baseline benchmarks compare with.
    extraction: bool = True
    #: a trained draft to serve (a speculators-format dir of a registered draft), with extraction
    #: off: its --speculative-config comes from the draft's plug-in and the checkpoint
    #: (trainer_client/drafts/serving.py: the method, P-EAGLE's parallel drafting, DFlash's block)
    draft: str | None = None
    num_speculative_tokens: int | None = None
    extra: list[str] = field(default_factory=list)


def extraction_configs(o: VllmOptions) -> tuple[dict, dict]:
    """(speculative_config, kv_transfer_config) for vLLM's extract_hidden_states method."""
    n = num_hidden_layers(o.model)
    ids = validate_layer_ids(o.layer_ids, n)
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
    }
    kvt = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": o.spool_dir,
            "notice_endpoint": o.notice_endpoint,
            "num_writer_threads": o.num_writer_threads,
            "layer_ids": ids,
            "layer_order": o.layer_order,
        },
    }
    return spec, kvt


def vllm_args(o: VllmOptions) -> list[str]:
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", o.model, "--host", o.host,
            "--port", str(o.port)]  # fmt: skip
    if o.extraction:
        spec, kvt = extraction_configs(o)
        args += ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kvt)]
    if o.draft:
        if o.extraction:
            raise ValueError("a served draft and hidden-state extraction both take --speculative-config: pick one")
        from trainer_client.drafts.serving import speculative_config  # the draft's plug-in says how

        args += ["--speculative-config", json.dumps(speculative_config(o.draft, o.num_speculative_tokens))]
    # Prefix caching is off unless asked for: see docs/prefix-caching.md.
    args.append("--enable-prefix-caching" if o.prefix_caching else "--no-enable-prefix-caching")
    args += ["--shutdown-timeout", str(o.shutdown_timeout_s)]
    if o.max_model_len:
        args += ["--max-model-len", str(o.max_model_len)]
    if o.gpu_memory_utilization:
        args += ["--gpu-memory-utilization", str(o.gpu_memory_utilization)]
    if o.enforce_eager:
        args.append("--enforce-eager")
    if o.served_model_name:
        args += ["--served-model-name", o.served_model_name]
    if dtype := cpu_serving_dtype(o.model, o.extra):
        print(f"hsstream: vLLM serves {o.model} in {dtype}: this CPU has no bf16 instructions ({', '.join(BF16_FLAGS)}), "
              f"where bf16 runs tens of times slower; {DTYPE_ENV} or --dtype to choose", file=sys.stderr, flush=True)  # fmt: skip
        args += ["--dtype", dtype]
    return args + list(o.extra)


def parallel_args(num_gpus: int, tensor_parallel_size: int = 1) -> list[str]:
    """vLLM's TP/DP flags for ``num_gpus`` GPUs: TP groups of ``tensor_parallel_size``, one
    data-parallel engine per group (2 GPUs, TP 1: DP 2; 4 GPUs, TP 2: DP 2)."""
    tp = max(1, tensor_parallel_size)
    if num_gpus < 1 or num_gpus % tp:
        raise ValueError(f"{num_gpus} GPU(s) cannot be split into tensor-parallel groups of {tp}")
    args = []
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    if num_gpus // tp > 1:
        args += ["--data-parallel-size", str(num_gpus // tp)]
    return args


def cpu_env(base: dict[str, str] | None = None, ranks: int = 1) -> dict[str, str]:
    """Environment for vLLM's CPU build: bind OpenMP threads explicitly.

    vLLM's default binding reserves a core without a speculative config and not with one, so
    unbound runs are not comparable; we always bind every core we may use. With ``ranks``
    tensor-parallel workers the cores are split between them (vLLM's ``a-b|c-d`` syntax).
    """
    env = dict(base if base is not None else os.environ)
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        cores = sorted(os.sched_getaffinity(0))
        if ranks > 1:
            if len(cores) < ranks:
                raise ValueError(f"{ranks} CPU ranks need at least {ranks} cores, this process may use {len(cores)}")
            per = len(cores) // ranks
            groups = [cores[i * per : (i + 1) * per] for i in range(ranks)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def is_cpu_build() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


class ProcessDied(RuntimeError):
    pass


@dataclass
class Child:
    """A child process in its own process group, so stopping it stops its workers too."""

    name: str
    proc: subprocess.Popen
    log_path: Path | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the leader only: vLLM's API server then stops its engine and workers in
        order, and they unlink their shared memory (a SIGTERM to the whole group kills them
        mid-teardown: "leaked shared_memory" warnings). The rest of the group gets its SIGTERM
        once the leader is gone, SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
                os.killpg(self.proc.pid, signal.SIGTERM)  # whatever the leader left behind
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        else:  # the leader is gone, its workers may not be
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode

    def tail(self, n: int = 40) -> str:
        if self.log_path and self.log_path.exists():
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


def spawn(name: str, args: list[str], env: dict[str, str], log_path: Path | None = None, cwd: str | None = None) -> Child:
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd
    )
    return Child(name, proc, log_path)


def wait_http(url: str, child: Child | None, timeout: float, on_tick=None) -> None:  # noqa: ANN001
    """Wait until ``url`` answers 200, failing fast (with its log) if the child dies."""
    t0 = time.monotonic()
    while True:
        if child is not None and not child.alive():
            raise ProcessDied(f"{child.name} exited with code {child.proc.returncode} while starting:\n{child.tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{url} not ready after {timeout:.0f} s" + (f":\n{child.tail()}" if child else ""))
        if on_tick:
            on_tick(time.monotonic() - t0)
        time.sleep(0.5)


def exit_0_on_stop() -> None:
    """SIGTERM and SIGINT end this process with status 0 (``SystemExit``, so ``finally`` blocks
    and context managers run): a stop that was asked for is not a failure, and a supervisor
    (``hsstream up``, compose) should read it as clean. Called by ``serve`` and ``train``."""

    def stop(_sig: int, _frame: object) -> None:
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def repo_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def child_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """Children must import our packages (vLLM loads the connector by module path). ``base``: the
    environment they start from (default: this process's, as it is now)."""
    base = dict(os.environ if base is None else base)
    env = cpu_env(base) if is_cpu_build() else base
    root = repo_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env
