"""Our arm: online. vLLM with our connector and the sidecar, started as ``hsstream up`` starts
them (:class:`hsstream.devstack.Stack`), on the producer cores; the conversations submitted as
one job; ``hsstream train`` (the command, as a user runs it) on the trainer cores, training from
the stream while vLLM produces.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.vs_speculators.common import ROOT, Sampler, finish_cpu, log, pinned_env, spawn_pinned, tail


def cpus_of(pids: list[int]) -> list[int]:
    """The cores the processes ``pids`` may run on, together (read from the kernel)."""
    cores: set[int] = set()
    for pid in pids:
        try:
            cores |= os.sched_getaffinity(pid)
        except OSError:
            pass
    return sorted(cores)


def job_options(z) -> dict:  # noqa: ANN001
    """The job as the sidecar takes it: loss on the assistant turns, each sample cut to the study's
    length (the same cut the speculators arm's rows had)."""
    return {"loss_mask": "assistant", "max_tokens_per_sample": z.tokens, "overlong": "truncate", "on_invalid": "reject"}


def train_command(verifier: str, run_dir: Path, job: str, stack, token_counts: Path, z, rc, aux: list[int],  # noqa: ANN001
                  steps: int) -> list[str]:  # fmt: skip
    """``hsstream train`` with the shared recipe (bench/vs_speculators/plan.py).

    Once ``hsstream train --submit`` takes the job options (issue 39, part 2), the REST submit in
    :func:`run` and ``--job`` here become one ``--submit ROWS.jsonl --submit-preset sharegpt
    --max-tokens-per-sample N --overlong truncate``."""
    return [
        sys.executable, "-m", "hsstream", "train", "--model", verifier, "--out", str(run_dir), "--job", job,
        "--api", stack.api, "--endpoint", stack.delivery_endpoint, "--spool", str(stack.spool),
        "--token-counts", str(token_counts), "--draft-vocab-size", str(z.draft_vocab),
        "--aux-layers", ",".join(map(str, aux)), "--lr", repr(rc.lr), "--weight-decay", repr(rc.weight_decay),
        "--betas", ",".join(map(repr, rc.betas)), "--schedule", rc.schedule, "--min-lr-ratio", repr(rc.min_lr_ratio),
        "--warmup", str(rc.warmup_steps(steps)), "--grad-clip", repr(rc.grad_clip),
        "--samples-per-step", str(rc.samples_per_step), "--max-tokens-per-step", str(z.tokens),
        "--ttt-steps", str(rc.ttt_steps), "--ttt-step-loss-decay", repr(rc.ttt_step_loss_decay),
        "--draft-attn-impl", rc.attn, "--checkpoint-every", str(max(1, steps // z.points)), "--keep-checkpoints", "0",
        "--threads", str(rc.torch_threads), "--seed", str(rc.seed), "--log-every", "10", "--no-progress",
        "--logger", "none", "--device", "cpu", "--autocast", "none",
    ]  # fmt: skip


def run(verifier: str, rows: list[dict], wd: Path, z, rc, split: dict, aux: list[int], n_layers: int,  # noqa: ANN001
        token_counts: Path, max_model_len: int) -> dict:  # fmt: skip
    from bench.served_acceptance.acceptance import submit
    from bench.online_vs_offline.online_vs_offline import producer_cores
    from bench.online_vs_offline.ovo_regimes import omp_bind
    from hsstream.devstack import Stack
    from trainer_client.train import checkpoints as M

    run_dir = wd / "run"
    wd.mkdir(parents=True, exist_ok=True)
    stack = Stack(verifier, [*aux, n_layers], wd, max_model_len=max_model_len)
    out: dict = {}
    t_start = time.perf_counter()
    try:
        with producer_cores(split):
            stack.start()
        producer_cpus = cpus_of([c.proc.pid for c in stack.children])
        out["vllm_start_s"] = round(time.perf_counter() - t_start, 1)
        log(f"our arm: vLLM + sidecar up in {out['vllm_start_s']:.0f} s (spool {stack.spool}); submitting, training")
        with Sampler({"checkpoints": run_dir}) as smp:
            t0 = time.time()
            job = submit(stack, rows, job_options(z))
            out["submit_s"] = round(time.time() - t0, 2)
            cmd = train_command(verifier, run_dir, job, stack, token_counts, z, rc, aux, len(rows))
            tr = spawn_pinned(cmd, split["trainer"], wd / "train.log", env=stack.client_env(pinned_env(split["trainer"])))
            trainer_cpus = cpus_of([tr.pid])  # read from the kernel while it runs
            code, out["trainer_cpu_s"] = finish_cpu(tr, 7200)
            out["trainer_exit_s"] = round(time.time() - t0, 1)
        if code != 0:
            raise RuntimeError(f"hsstream train failed ({code}):\n{tail(wd / 'train.log')}")
        with stack.client(timeout=60) as c:
            st = c.job(job)
            ledger = [(s.index, s.token_ids, s.loss_mask) for s in c.iter_job_samples(job)]
        out["job"] = {"id": job, "done": st.done, "counts": st.counts, "num_samples": st.num_samples,
                      "errors": [e.model_dump() for e in st.errors]}  # fmt: skip
        out["spool_files_left"] = len(stack.spool_files())
    finally:
        stack.stop()
        stack.remove_spool()
    out["command"] = cmd[2:]
    out["job_options"] = job_options(z)
    run_json = json.loads((run_dir / "run.json").read_text())
    out["run"] = {k: run_json.get(k) for k in ("config", "aux_layer_ids", "draft_vocab_size", "vocab_coverage", "device",
                                               "autocast")}  # fmt: skip
    keys = []
    for line in (run_dir / "trained_keys.jsonl").read_text().splitlines():
        keys += json.loads(line)["keys"]
    out["trained_keys"] = len(keys)
    out["trained_twice"] = len(keys) - len(set(keys))
    trained_idx = {int(k.split("/")[2]) for k in keys}
    out["_ledger"] = [(ids, m) for i, ids, m in ledger if i in trained_idx]  # the caller hashes it (not in the JSON)
    out["ledger_samples"] = len(ledger)
    out["checkpoints"] = []
    for step, path in M.list_checkpoints(run_dir):
        s = M.load_state(path)
        out["checkpoints"].append({"step": int(step), "t_s": round(float(s["time"]) - t0, 2), "draft": str(path / M.DRAFT_DIR)})
    out["steps"] = out["checkpoints"][-1]["step"] if out["checkpoints"] else 0
    out["wall_s"] = out["checkpoints"][-1]["t_s"] if out["checkpoints"] else None
    out["affinity"] = {"producer": producer_cpus, "vllm_omp_threads_bind": omp_bind(split["producer"]),
                       "trainer": trainer_cpus}  # fmt: skip
    out.update(smp.result())
    return out


__all__ = ["ROOT", "cpus_of", "job_options", "run", "train_command"]
