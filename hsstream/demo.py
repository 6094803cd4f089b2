"""``make demo``'s first part: the stream on this machine, on the real verifier (or the tiny one).

Starts vLLM (with our connector) and the sidecar as real processes,
submits prompts over REST, consumes them with ``HiddenStateStream`` and prints what flowed.
It exits non-zero if anything is lost or left behind in the spool.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from rich.console import Console

from connector.contract.rest_client import SidecarClient
from hsstream import launch
from hsstream.devstack import Stack

console = Console(stderr=True)

_WORDS = (
    "the model reads a prompt and writes hidden states into shared memory while a trainer "
    "learns to draft tokens faster streaming tensors over sockets without touching disk"
).split()


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


def run_demo(num_prompts: int = 32, workdir: str | None = None, model: str = "tiny") -> int:
    """``model``: a checkpoint folder, or "tiny" for the tiny test verifier (built, then cached)."""
    from trainer_client import HiddenStateStream

    t_all = time.perf_counter()
    if model == "tiny":
        from hsstream.tiny_model import build_tiny_verifier

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
