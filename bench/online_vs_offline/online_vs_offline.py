#!/usr/bin/env python3
"""Online vs offline Eagle-3 training on the same samples and the same clock (CPU, tiny verifier).

Three arms, one after the other, each from its first request to its final checkpoint:

* **offline**: plain vLLM with our connector (no sidecar, ``notice_endpoint: none``) writes
  every sample's file to a kept directory on disk, as speculators' offline data generation
  does (``/v1/completions`` with ``max_tokens=1``, the file named by the response's
  ``kv_transfer_params.hidden_states_path``); vLLM is stopped, then the trainer trains E
  epochs reading those files (``read_hidden_states``), vLLM no longer sharing the cores;
* **online**: the same documents as one sidecar job with ``epochs=E``, trained while vLLM
  produces (HiddenStateStream, deferred acks);
* **online, regenerated**: prompts cut from the same documents, the verifier writes the
  replies (``mode=regenerate``, half at T=0, half at T=1), one pass.

Same verifier, documents, draft vocabulary (one token-count file), draft config, optimizer,
LR schedule, seed, trainer threads (1) and vLLM thread binding in every arm. Each trainer
checkpoints at every multiple of ``--grid-s`` seconds after its arm's first request (and at
the end); afterwards vLLM serves each checkpoint as the Eagle-3 draft (bench/served_acceptance/acceptance.py's
serving code: T=0 and T=1 on held-out prompts, acceptance from vLLM's spec-decode counters).
The JSON records, per arm, a hash of (epoch, index, token ids) of every sample trained on
(equal for offline and online; the regenerated arm trains on other tokens by design, so its
hash differs and its prompts' hash is recorded), disk bytes at peak, the in-run held-out
top-1 (``--eval-every``), and the curves. Run it alone (it starts vLLM several times):

    flock /tmp/hsstream-pytest.lock python bench/online_vs_offline/online_vs_offline.py            # ~20 min on 2 cores
    flock /tmp/hsstream-pytest.lock python bench/online_vs_offline/online_vs_offline.py --smoke    # ~5 min, checks the plumbing

``--regime balanced|disk_limited|fresh_replies`` runs instead one of the regimes where streaming
should beat writing to disk first (``main_regime``; sizes, checks and the core split in
bench/online_vs_offline/ovo_regimes.py, the how-to in docs/benchmarks.md). Its arms are offline/online pairs, with
vLLM on one half of the cores and the trainer on the other in every arm, so the pairs differ in
the data path only. Output: ``bench/results/online_vs_offline_<regime>_cpu.json``; a smoke run
writes under /tmp.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.served_acceptance.acceptance import LAYERS, log, run_serving, submit  # noqa: E402
from bench.common.disk_peaks import PeakSampler, tree_bytes  # noqa: E402

ARMS = ("offline", "online", "online_regenerated")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def samples_hash(rows: list[tuple]) -> str:
    """sha256 over the sorted (epoch, index, token-ids digest) of every sample an arm trained from."""
    h = hashlib.sha256()
    for e, i, d in sorted({(r[1], r[2], r[3]) for r in rows}):
        h.update(f"{e}:{i}:{d}\n".encode())
    return h.hexdigest()


def prompts_hash(pairs: set[tuple[str, str]]) -> str:
    """sha256 over sorted (sample id, digest of its prompt's token ids): the regenerated arm's
    samples differ from the documents by design (the verifier's own replies), their prompts not."""
    h = hashlib.sha256()
    for label, d in sorted(pairs):
        h.update(f"{label}:{d}\n".encode())
    return h.hexdigest()


def prompt_part(token_ids, loss_mask):  # noqa: ANN001, ANN201
    """A regenerated sample's prompt: the tokens before the first one with loss (the reply's)."""
    if loss_mask is None or not bool(loss_mask.any()) or bool(loss_mask[0]):
        return token_ids
    return token_ids[: int(loss_mask.int().argmax())]


def wait_for_file(path: str, timeout_s: float = 120.0) -> None:
    """As a client of vLLM's Example connector: wait on ``<path>.lock``, then remove it (the reader's job)."""
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)
        Path(lock).unlink(missing_ok=True)
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"vLLM named {path} but never wrote it")
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------
# The trainer (a child process per arm: same interpreter, same thread setting)
# --------------------------------------------------------------------------------------------


class Tap:
    """The stream as the trainer sees it, recording what each sample carried (for the hash)."""

    def __init__(self, inner, rows: list) -> None:  # noqa: ANN001
        self.inner, self.rows = inner, rows

    def __iter__(self):  # noqa: ANN204
        from trainer_client.train.trainer import token_digest

        for s in self.inner:
            self.rows.append((s.key.job, s.key.epoch, s.key.index, token_digest(s.token_ids), s.label,
                              token_digest(prompt_part(s.token_ids, s.loss_mask))))  # fmt: skip
            yield s

    def __getattr__(self, name: str):  # noqa: ANN204 - keepalive, ack_through of the real stream
        return getattr(self.inner, name)


def train_child(spec: dict) -> dict:
    if spec.get("cpus"):  # the regimes' core split: the trainer on its own cores in every arm
        os.sched_setaffinity(0, spec["cpus"])
    from connector import protocol as P
    from trainer_client.train import vocab as V
    from trainer_client.eagle3 import Eagle3OnlineTrainer, TrainConfig
    from trainer_client.stream import HiddenStateStream, read_hidden_states

    import torch

    cfg = TrainConfig(**spec["cfg"])
    counts = V.token_counts_from_file(spec["counts"])
    rows: list = []
    if spec.get("shards") is not None:
        from_disk = sharded_source(spec)
        trainer = Eagle3OnlineTrainer(cfg, counts)
        res = trainer.train(Tap(from_disk(), rows))
    elif spec["files"] is not None:
        files = spec["files"]
        plens = spec.get("prompt_lens")

        def from_disk():  # noqa: ANN202
            for e in range(spec["epochs"]):
                for i, path in enumerate(files):
                    s = read_hidden_states(path)
                    if plens is not None:  # a reply the verifier wrote: loss on the reply only, as online
                        s = dataclasses.replace(s, loss_mask=torch.arange(len(s.token_ids)) >= plens[i])
                    # files[i] is document i: the id the online arms' jobs give it
                    yield dataclasses.replace(s, key=P.SampleKey(job="offline", index=i, epoch=e), label=f"doc-{i}")

        trainer = Eagle3OnlineTrainer(cfg, counts)
        res = trainer.train(Tap(from_disk(), rows))
    else:
        from trainer_client.train.run import drained_probe

        trainer = Eagle3OnlineTrainer(cfg, counts, drained=drained_probe(spec["api"], spec["jobs"], spec.get("token")))
        with HiddenStateStream(spec["endpoint"], jobs=spec["jobs"], spool_dir=spec["spool"], ack="manual",
                               timeout_s=600, credit=8) as stream:  # fmt: skip
            res = trainer.train(Tap(stream, rows))
    keys = [(r[0], r[1], r[2]) for r in rows]
    extra = {}
    if spec.get("record_digests"):  # (epoch, index, token digest) of every sample, for reply differences
        extra["digests"] = [[r[1], r[2], r[3]] for r in rows]
    if spec.get("shards") is not None:
        extra["shard_log"] = SHARD_LOG
    return {
        **extra,
        "trainer_cpus": sorted(os.sched_getaffinity(0)),
        "result": res.summary(),
        "evals": [h for h in res.history if "eval_top1_0" in h],
        "samples_hash": samples_hash(rows),
        "delivered": len(rows),
        "delivered_twice": len(keys) - len(set(keys)),
        "heldout_repeats_skipped": trainer.heldout_repeats,
        # the same documents in every arm (eval_ids), whenever each arm's order brought them
        "held_out_ids": sorted(trainer.heldout_ids),
        "prompts_hash": prompts_hash({(r[4], r[5]) for r in rows}),
    }


SHARD_LOG: list[dict] = []


def sharded_source(spec: dict):  # noqa: ANN201
    """Offline under a disk budget: per epoch, per shard, vLLM writes the shard's files, the
    trainer trains on them, they are deleted, the next shard is written."""
    import httpx

    from connector import protocol as P
    from trainer_client.stream import read_hidden_states

    url, docs, files_dir = spec["vllm_url"], spec["docs"], Path(spec["files_dir"])
    client = httpx.Client(timeout=300)

    def one(doc: str) -> str:
        r = client.post(f"{url}/v1/completions", json={"model": "verifier", "prompt": doc, "max_tokens": 1})
        r.raise_for_status()
        path = r.json()["kv_transfer_params"]["hidden_states_path"]
        wait_for_file(path)
        return path

    def gen():  # noqa: ANN202
        for e in range(spec["epochs"]):
            for k, shard in enumerate(spec["shards"]):
                t0 = time.time()
                with ThreadPoolExecutor(16) as ex:
                    paths = list(ex.map(one, [docs[i] for i in shard]))
                SHARD_LOG.append({"epoch": e, "shard": k, "samples": len(shard), "extract_s": round(time.time() - t0, 2),
                                  "bytes": sum(os.stat(p).st_size for p in paths)})  # fmt: skip
                for i, path in zip(shard, paths, strict=True):
                    s = read_hidden_states(path)
                    yield dataclasses.replace(s, key=P.SampleKey(job="offline", index=i, epoch=e), label=f"doc-{i}")
                for path in paths:  # the shard is trained on: its files go, the next shard's come
                    Path(path).unlink(missing_ok=True)
                    Path(path + ".lock").unlink(missing_ok=True)
        client.close()

    return gen


def run_trainer(spec: dict, workdir: Path, name: str) -> dict:
    (workdir / f"{name}.train.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(workdir / f"{name}.train.log", "wb") as fh:
        p = subprocess.run(
            [sys.executable, __file__, "--train-child", str(workdir / f"{name}.train.json"),
             str(workdir / f"{name}.train.out.json")],
            env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(ROOT), timeout=3600,
        )  # fmt: skip
    if p.returncode != 0:
        tail = (workdir / f"{name}.train.log").read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"trainer of {name} failed ({p.returncode}):\n" + "\n".join(tail))
    return json.loads((workdir / f"{name}.train.out.json").read_text())


def checkpoints_of(run_dir: Path, t0: float) -> list[dict]:
    from trainer_client.train import checkpoints as M

    out = []
    for step, path in M.list_checkpoints(run_dir):
        st = M.load_state(path)
        out.append({"step": int(step), "t_s": round(float(st["time"]) - t0, 2), "samples": int(st["samples_trained"]),
                    "draft": str(path / M.DRAFT_DIR)})  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# The arms
# --------------------------------------------------------------------------------------------


def train_cfg(a, verifier: str, run_dir: Path, t0: float, steps: int) -> dict:  # noqa: ANN001
    return {
        "verifier": verifier, "out_dir": str(run_dir), "draft_vocab_size": a.draft_vocab_size, "lr": a.lr,
        "schedule_steps": steps, "checkpoint_every": 10**9, "checkpoint_every_s": a.grid_s, "clock_origin": t0,
        "keep_checkpoints": 0, "eval_every": a.eval_every, "eval_samples": a.eval_samples, "seed": 0, "threads": 1,
        "eval_ids": [f"doc-{i}" for i in range(a.eval_samples)],  # the same held-out documents in every arm
        "progress": False, "tensorboard": False, "aux_layer_ids": getattr(a, "aux_layer_ids", None),
    }  # fmt: skip


def arm_offline(a, verifier: str, docs: list[str], counts: Path, wd: Path) -> dict:  # noqa: ANN001
    import httpx

    from hsstream import launch
    from hsstream.devstack import free_port

    files_dir, run_dir = wd / "offline" / "files", wd / "offline" / "run"
    files_dir.mkdir(parents=True)
    port = free_port()
    opts = launch.VllmOptions(
        model=verifier, layer_ids=LAYERS, spool_dir=str(files_dir), notice_endpoint="none", port=port,
        max_model_len=1024, gpu_memory_utilization=0.2 if launch.is_cpu_build() else None, enforce_eager=True,
        served_model_name="verifier",
    )  # fmt: skip
    t_start = time.perf_counter()
    child = launch.spawn("vllm", launch.vllm_args(opts), launch.child_env(), wd / "offline" / "vllm.log")
    with PeakSampler({"files": files_dir, "checkpoints": run_dir}) as peak:
        try:
            launch.wait_http(f"http://127.0.0.1:{port}/v1/models", child, timeout=600)
            t_stack = time.perf_counter() - t_start
            log(f"offline: vLLM (plain, our connector writing to {files_dir}) up in {t_stack:.0f} s")
            client = httpx.Client(timeout=300)

            def one(doc: str) -> str:
                r = client.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"model": "verifier", "prompt": doc, "max_tokens": 1})  # fmt: skip
                r.raise_for_status()
                path = r.json()["kv_transfer_params"]["hidden_states_path"]
                wait_for_file(path)
                return path

            t0 = time.time()
            with ThreadPoolExecutor(16) as ex:  # requests in flight, as a data-generation client keeps them
                files = list(ex.map(one, docs))
            t_gen = time.time() - t0
            log(f"offline: {len(files)} files written in {t_gen:.0f} s ({tree_bytes(files_dir) / 1e6:.1f} MB on disk)")
        finally:
            child.stop()
        t_stopped = time.time() - t0
        steps = (len(docs) - a.eval_samples) * a.epochs
        spec = {"cfg": train_cfg(a, verifier, run_dir, t0, steps), "counts": str(counts), "files": files,
                "epochs": a.epochs}  # fmt: skip
        tr = run_trainer(spec, wd, "offline")
    ck = checkpoints_of(run_dir, t0)
    return {
        "phases_s": {"generate": round(t_gen, 1), "vllm_stopped_at": round(t_stopped, 1),
                     "train": round(ck[-1]["t_s"] - t_stopped, 1)},  # fmt: skip
        "wall_s": ck[-1]["t_s"],
        "vllm_start_s": round(t_stack, 1),
        "disk_peak_bytes": {"data": peak.peak["files"], "checkpoints": peak.peak["checkpoints"],
                            "total": peak.peak_sum},  # fmt: skip
        "files": len(files),
        "checkpoints": ck,
        **tr,
    }


def arm_online(a, verifier: str, jobs_spec: list[tuple[list[dict], dict]], counts: Path, wd: Path, name: str,
               steps: int, *, layers: list[int] = LAYERS, split: dict | None = None, env: dict | None = None,
               record_digests: bool = False) -> dict:  # fmt: skip
    from hsstream.devstack import Stack

    run_dir = wd / name / "run"
    (wd / name).mkdir(parents=True)
    stack = Stack(verifier, layers, wd / name)
    stack.env.update(env or {})
    t_start = time.perf_counter()
    try:
        with producer_cores(split):
            stack.start()
        producer_cpus = cpus_of([c.proc.pid for c in stack.children])  # vLLM and the sidecar, running
        t_stack = time.perf_counter() - t_start
        log(f"{name}: vLLM + sidecar up in {t_stack:.0f} s, spool {stack.spool}")
        with PeakSampler({"spool": stack.spool, "checkpoints": run_dir}) as peak:
            t0 = time.time()
            jobs = [submit(stack, smp, opts) for smp, opts in jobs_spec]
            spec = {"cfg": train_cfg(a, verifier, run_dir, t0, steps), "counts": str(counts), "files": None,
                    "jobs": jobs, "api": stack.api, "token": stack.token, "endpoint": stack.delivery_endpoint,
                    "spool": str(stack.spool),
                    "cpus": split["trainer"] if split else None, "record_digests": record_digests}  # fmt: skip
            tr = run_trainer(spec, wd, name)
        left = stack.spool_files()
    finally:
        stack.stop()
        stack.remove_spool()
    ck = checkpoints_of(run_dir, t0)
    return {
        "wall_s": ck[-1]["t_s"],
        "vllm_start_s": round(t_stack, 1),
        # the spool is /dev/shm (memory), never disk; the data's disk footprint is nil
        "disk_peak_bytes": {"data": 0, "checkpoints": peak.peak["checkpoints"], "total": peak.peak["checkpoints"]},
        "spool_peak_bytes_in_memory": peak.peak["spool"],
        "spool_files_left": len(left),
        "jobs": [{"samples": len(s), "options": o} for s, o in jobs_spec],
        "checkpoints": ck,
        **({"affinity": affinity_of(split, tr, producer_cpus)} if split else {}),
        **tr,
    }


class producer_cores:  # noqa: N801 - a context manager used as a statement
    """While vLLM (and the sidecar) start: this process and what it spawns on the producer cores,
    vLLM's OpenMP threads bound to them; afterwards as before. ``None``: no split."""

    def __init__(self, split: dict | None) -> None:
        self.split = split

    def __enter__(self) -> None:
        if not self.split:
            return
        from bench.online_vs_offline.ovo_regimes import omp_bind

        self.before = os.sched_getaffinity(0), os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        os.sched_setaffinity(0, self.split["producer"])
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(self.split["producer"])

    def __exit__(self, *exc: object) -> None:
        if not self.split:
            return
        os.sched_setaffinity(0, self.before[0])
        if self.before[1] is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.before[1]


def cpus_of(pids: list[int]) -> list[int]:
    """The cores the processes ``pids`` may run on, together (read from the kernel)."""
    cores: set[int] = set()
    for pid in pids:
        try:
            cores |= os.sched_getaffinity(pid)
        except OSError:  # gone already: nothing to add
            pass
    return sorted(cores)


def affinity_of(split: dict, tr: dict, producer_cpus: list[int]) -> dict:
    """An arm's cores as they were: the producer processes' (vLLM, the sidecar: read from the
    kernel while they ran), vLLM's OpenMP binding, and the trainer's (what its process reported)."""
    from bench.online_vs_offline.ovo_regimes import omp_bind

    return {"producer": producer_cpus, "vllm_omp_threads_bind": omp_bind(split["producer"]),
            "trainer": tr["trainer_cpus"]}  # fmt: skip


def arm_offline_regime(a, verifier: str, docs: list[str], counts: Path, wd: Path, name: str, *, epochs: int,  # noqa: ANN001
                       layers: list[int], split: dict, shards: list[list[int]] | None = None,
                       regen: dict | None = None) -> dict:  # fmt: skip
    """The offline arm of a regime: vLLM on the producer cores writes the files (all at once;
    ``shards``: one shard at a time, trained on and deleted before the next; ``regen``: the
    verifier's sampled replies to the prompts, written once), the trainer on its cores."""
    import httpx

    from hsstream import launch
    from hsstream.devstack import free_port

    files_dir, run_dir = wd / name / "files", wd / name / "run"
    files_dir.mkdir(parents=True)
    port = free_port()
    opts = launch.VllmOptions(
        model=verifier, layer_ids=layers, spool_dir=str(files_dir), notice_endpoint="none", port=port,
        max_model_len=1024, gpu_memory_utilization=0.2 if launch.is_cpu_build() else None, enforce_eager=True,
        served_model_name="verifier",
    )  # fmt: skip
    t_start = time.perf_counter()
    with producer_cores(split):
        child = launch.spawn("vllm", launch.vllm_args(opts), launch.child_env(), wd / name / "vllm.log")
    n_eval = a.eval_samples
    steps = (len(docs) - n_eval) * epochs
    spec: dict = {"counts": str(counts), "epochs": epochs, "cpus": split["trainer"], "files": None}
    with PeakSampler({"files": files_dir, "checkpoints": run_dir}) as peak:
        try:
            launch.wait_http(f"http://127.0.0.1:{port}/v1/models", child, timeout=600)
            producer_cpus = cpus_of([child.proc.pid])  # vLLM, running
            t_stack = time.perf_counter() - t_start
            log(f"{name}: vLLM (plain, our connector writing to {files_dir}) up in {t_stack:.0f} s")
            t0 = time.time()
            spec["cfg"] = train_cfg(a, verifier, run_dir, t0, steps)
            if shards is not None:
                spec.update(shards=shards, docs=docs, vllm_url=f"http://127.0.0.1:{port}", files_dir=str(files_dir))
                tr = run_trainer(spec, wd, name)
                t_gen = sum(x["extract_s"] for x in tr["shard_log"])
            else:
                client = httpx.Client(timeout=300)

                def one(doc: str | dict) -> str:
                    body = {"model": "verifier", "prompt": doc, "max_tokens": 1}
                    if regen is not None:  # doc: {"ids": prompt token ids}; the reply's states too
                        body = {"model": "verifier", "prompt": doc["ids"], **regen["sampling"], "return_token_ids": True,
                                "kv_transfer_params": {"include_output_tokens": True}}  # fmt: skip
                    r = client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                    r.raise_for_status()
                    path = r.json()["kv_transfer_params"]["hidden_states_path"]
                    wait_for_file(path)
                    return path

                items = docs if regen is None else [{"ids": ids} for ids in regen["prompt_ids"]]
                with ThreadPoolExecutor(16) as ex:
                    files = list(ex.map(one, items))
                t_gen = time.time() - t0
                log(f"{name}: {len(files)} files written in {t_gen:.0f} s ({tree_bytes(files_dir) / 1e6:.1f} MB)")
                child.stop()
                spec["files"] = files
                if regen is not None:
                    spec["prompt_lens"] = [len(ids) for ids in regen["prompt_ids"]]
                tr = run_trainer(spec, wd, name)
        finally:
            child.stop()
    ck = checkpoints_of(run_dir, t0)
    out = {
        "phases_s": {"generate": round(t_gen, 1), "train": round(ck[-1]["t_s"] - t_gen, 1)},
        "wall_s": ck[-1]["t_s"],
        "vllm_start_s": round(t_stack, 1),
        "disk_peak_bytes": {"data": peak.peak["files"], "checkpoints": peak.peak["checkpoints"],
                            "total": peak.peak_sum},  # fmt: skip
        "epochs": epochs,
        "checkpoints": ck,
        "affinity": affinity_of(split, tr, producer_cpus),
        **tr,
    }
    out["steps"] = tr["result"]["steps"]
    return out


# --------------------------------------------------------------------------------------------
# Serving the checkpoints
# --------------------------------------------------------------------------------------------


def pick_points(ck: list[dict], max_points: int, grid_s: float) -> list[dict]:
    """One checkpoint per wall-clock grid interval (the first in it) and the final one; evenly
    spaced among those if more than ``max_points``. (At a job's tail the trainer checkpoints
    after every step: those would otherwise crowd out the grid.)"""
    seen, grid = set(), []
    for c in ck[:-1]:
        b = int(c["t_s"] // grid_s)
        if b not in seen:
            seen.add(b)
            grid.append(c)
    ck = [*grid, ck[-1]]
    if len(ck) <= max_points:
        return ck
    idx = sorted({round(i * (len(ck) - 1) / (max_points - 1)) for i in range(max_points)})
    return [ck[i] for i in idx]


#: Checkpoints every arm takes at the same scheduled wall-clock tick land this far apart at most
#: (the trainer checks the clock between steps): they count as taken at the same time.
SAME_TICK_S = 1.0


def at_time(curve: list[dict], t: float) -> dict | None:
    """The newest served point of a curve that existed at wall-clock ``t`` (s after the first
    request), counting one taken at the same scheduled tick a little after ``t``."""
    have = [p for p in curve if p["t_s"] <= t + SAME_TICK_S]
    return have[-1] if have else None


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    untrained = result["untrained"]
    colors = {"offline": "tab:red", "online": "tab:blue", "online_regenerated": "tab:green"}
    for ax, temp in zip(axes, ("T0", "T1")):
        for arm in ARMS:
            curve = result["arms"][arm]["curve"]
            xs = [0.0] + [p["t_s"] for p in curve]
            ys = [untrained[temp]] + [p[temp] for p in curve]
            ax.step(xs, ys, where="post", color=colors[arm], alpha=0.35)
            ax.plot(xs[1:], ys[1:], "o", color=colors[arm], label=arm.replace("_", ", "))
        off = result["arms"]["offline"]
        ax.axvline(off["phases_s"]["generate"], color="tab:red", ls=":", lw=1)
        ax.text(off["phases_s"]["generate"], 0.02, " offline: files written", color="tab:red", fontsize=8)
        ax.set_title(f"served acceptance, {'T=0' if temp == 'T0' else 'T=1'} (num_speculative_tokens=3)")
        ax.set_xlabel("wall-clock from the first request (s)")
        ax.set_ylabel("accepted / drafted")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Eagle-3 draft, same {result['samples']} documents x {result['epochs']} epochs, tiny verifier, "
                 f"{result['machine']['cpus']} CPU cores", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------
# Regimes (bench/online_vs_offline/ovo_regimes.py): where streaming should beat writing to disk first
# --------------------------------------------------------------------------------------------

REGIME_COLORS = ("tab:red", "tab:blue", "tab:orange", "tab:cyan")


def plot_regime(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    untrained = result["untrained"]
    for ax, temp in zip(axes, ("T0", "T1")):
        for color, (arm, r) in zip(REGIME_COLORS, result["arms"].items()):
            xs = [0.0] + [p["t_s"] for p in r["curve"]]
            ys = [untrained[temp]] + [p[temp] for p in r["curve"]]
            ax.step(xs, ys, where="post", color=color, alpha=0.35)
            ax.plot(xs[1:], ys[1:], "o", color=color, label=arm.replace("_", ", "))
        ax.set_title(f"served acceptance, {'T=0' if temp == 'T0' else 'T=1'} (num_speculative_tokens=3)")
        ax.set_xlabel("wall-clock from the first request (s)")
        ax.set_ylabel("accepted / drafted")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"regime {result['regime']}: {result['samples']} documents, epochs {result['epochs']}, "
                 f"{result['verifier_layers']}-layer verifier, cores {result['split']}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main_regime(a) -> int:  # noqa: ANN001, C901, PLR0915
    import random

    import torch

    from bench.online_vs_offline import ovo_regimes as R
    from hsstream import pretrain_verifier as PV
    from trainer_client.drafts import eagle3 as E3
    from trainer_client.train import vocab as V
    from trainer_client.train.trainer import token_digest

    regime = a.regime
    z = (R.SMOKE if a.smoke else R.FULL)[regime]
    if a.verifier_layers:
        z = dataclasses.replace(z, verifier_layers=a.verifier_layers)
    for k in ("eval_every", "eval_samples", "eval_prompts", "max_tokens", "regen_max_tokens", "grid_s", "max_points"):
        setattr(a, k.replace("-", "_"), getattr(z, k))
    min_points = 2 if a.smoke else 4
    suffix = "_smoke" if a.smoke else ""
    out = Path(a.out or (Path("/tmp") if a.smoke else ROOT / "bench" / "results") / f"online_vs_offline_{regime}_cpu{suffix}.json")

    t_all = time.perf_counter()
    wd = Path(a.workdir or tempfile.mkdtemp(prefix=f"hsstream-ovo-{regime}-"))
    wd.mkdir(parents=True, exist_ok=True)
    log(f"regime {regime}{' (smoke)' if a.smoke else ''}: {z}; workdir {wd}")
    split = R.split_cores(os.sched_getaffinity(0))
    log(f"cores: producer (vLLM, sidecar) {split['producer']}, trainer {split['trainer']}")
    t_v = time.perf_counter()
    verifier = str(R.padded_verifier(PV.pretrained_verifier(), z.verifier_layers))
    t_v = time.perf_counter() - t_v
    layers = R.layers_for(z.verifier_layers)
    hidden = json.loads((Path(verifier) / "config.json").read_text())["hidden_size"]
    docs = PV.corpus_documents(z.samples, PV.SEED_DRAFT_TRAIN)
    samples = [{"id": f"doc-{i}", "prompt": d} for i, d in enumerate(docs)]
    counts = wd / "token_counts.json"
    V.save_token_counts(V.token_counts_from_samples(verifier, samples, "all"), counts)
    n_train = len(docs) - a.eval_samples
    a.aux_layer_ids = layers[:3]  # the draft reads the layers extracted (not N//2, N-3 of a deeper verifier)

    arms: dict[str, dict] = {}
    pairs: list[list[str]] = []
    facts: dict = {}
    extra: dict = {}
    if regime == "balanced":
        for e in z.epochs:
            off, on = f"offline_e{e}", f"online_e{e}"
            arms[off] = arm_offline_regime(a, verifier, docs, counts, wd, off, epochs=e, layers=layers, split=split)
            log(f"{off}: final checkpoint at {arms[off]['wall_s']:.0f} s")
            arms[on] = arm_online(a, verifier, [(samples, {"loss_mask": "all", "epochs": e})], counts, wd, on,
                                  n_train * e, layers=layers, split=split)  # fmt: skip
            log(f"{on}: final checkpoint at {arms[on]['wall_s']:.0f} s")
            pairs.append([off, on])
        ratio = {}
        for off, _ in pairs:
            ph = arms[off]["phases_s"]
            produce = ph["generate"] / len(docs)
            # the training loop's own time (not the trainer process's start-up), evaluations included
            step = arms[off]["result"]["wall_s"] / max(1, arms[off]["result"]["steps"])
            ratio[off] = round(produce / step, 3)
            extra.setdefault("balance", {})[off] = {"produce_s_per_sample": round(produce, 4),
                                                    "train_s_per_step": round(step, 4), "ratio": ratio[off]}  # fmt: skip
        facts["balance_ratio"] = ratio
    elif regime == "disk_limited":
        (e,) = z.epochs
        ids = V.tokenize_samples(verifier, samples, "all")
        sizes = [R.sample_bytes_estimate(len(t), len(layers), hidden) for t, _ in ids]
        budget = int(sum(sizes) * R.DISK_SHARE)
        shards = R.plan_shards(sizes, budget)
        log(f"disk budget {budget / 1e6:.1f} MB (a tenth of ~{sum(sizes) / 1e6:.1f} MB), {len(shards)} shards")
        arms["offline"] = arm_offline_regime(a, verifier, docs, counts, wd, "offline", epochs=e, layers=layers,
                                             split=split, shards=shards)  # fmt: skip
        log(f"offline (sharded): final checkpoint at {arms['offline']['wall_s']:.0f} s")
        arms["online"] = arm_online(a, verifier, [(samples, {"loss_mask": "all", "epochs": e})], counts, wd, "online",
                                    n_train * e, layers=layers, split=split,
                                    env={"HSSTREAM_SPOOL_BUDGET_BYTES": str(budget)})  # fmt: skip
        log(f"online (spool budget): final checkpoint at {arms['online']['wall_s']:.0f} s")
        pairs.append(["offline", "online"])
        log0 = [x for x in arms["offline"]["shard_log"] if x["epoch"] == 0]
        facts["disk"] = {
            "budget": budget, "estimated_dataset_bytes": sum(sizes), "dataset_bytes": sum(x["bytes"] for x in log0),
            # the poll may fall between a shard's last file and its deletion: the shard's own bytes count too
            "offline_peak": max(arms["offline"]["disk_peak_bytes"]["data"], max(x["bytes"] for x in log0)),
            "shards": len(shards), "spool_peak": arms["online"]["spool_peak_bytes_in_memory"],
        }  # fmt: skip
        extra["disk"] = facts["disk"]
    else:
        (e,) = z.epochs
        rng = random.Random(PV.SEED_DRAFT_TRAIN + 1)
        prompts = [d[: rng.randint(min(40, len(d) - 1), min(200, len(d) - 1))] for d in docs]
        regen_samples = [{"id": f"doc-{i}", "prompt": p} for i, p in enumerate(prompts)]
        regen_ids = V.tokenize_samples(verifier, regen_samples, "all", mode="regenerate")  # as the sidecar does
        assert len(regen_ids) == len(regen_samples), "the sidecar would refuse some regenerated prompts"
        want = prompts_hash({(x["id"], token_digest(torch.tensor(t))) for x, (t, _) in zip(regen_samples, regen_ids)})
        extra["regenerated_prompts_hash"] = want
        sampling = {"max_tokens": a.regen_max_tokens, "temperature": 1.0, "seed": 7}
        arms["offline"] = arm_offline_regime(a, verifier, docs, counts, wd, "offline", epochs=e, layers=layers,
                                             split=split, regen={"prompt_ids": [t for t, _ in regen_ids],
                                                                 "sampling": sampling})  # fmt: skip
        log(f"offline (replies once, {e} epochs): final checkpoint at {arms['offline']['wall_s']:.0f} s")
        arms["online"] = arm_online(a, verifier, [(regen_samples, {"mode": "regenerate", "loss_mask": "all",
                                                                   "sampling": sampling, "epochs": e})],
                                    counts, wd, "online", n_train * e, layers=layers, split=split,
                                    record_digests=True)  # fmt: skip
        log(f"online (fresh replies every epoch): final checkpoint at {arms['online']['wall_s']:.0f} s")
        pairs.append(["offline", "online"])
        facts["reply_differences"] = R.reply_differences([tuple(r) for r in arms["online"].pop("digests")])
        extra["reply_differences"] = facts["reply_differences"]
    for r in arms.values():
        r["steps"] = r["result"]["steps"]

    # -- serve -------------------------------------------------------------------------------------
    eval_prompts = PV.held_out_prompts(a.eval_prompts)
    first = next(iter(arms))
    maps = torch.load(wd / first / "run" / "vocab_maps.pt", weights_only=True)
    for arm in arms:
        other = torch.load(wd / arm / "run" / "vocab_maps.pt", weights_only=True)
        assert torch.equal(other["t2d"], maps["t2d"]) and torch.equal(other["d2t"], maps["d2t"]), arm
    untrained = E3.build_draft(verifier, layers[:3], draft_vocab_size=maps["draft_vocab_size"], t2d=maps["t2d"],
                               d2t=maps["d2t"], seed=0)  # fmt: skip
    untrained.save_pretrained(wd / "untrained-draft")

    def serve(draft: str, tag: str) -> dict:
        r = run_serving(verifier, draft, eval_prompts, a.max_tokens, [0.0, 1.0], wd, tag)
        return {"T0": r["0.0"]["acceptance_rate"] or 0.0, "T1": r["1.0"]["acceptance_rate"] or 0.0,
                "engine_wall_s": r["engine_wall_s"]}  # fmt: skip

    t_serve = time.perf_counter()
    u = serve(str(wd / "untrained-draft"), "untrained")
    for arm in arms:
        curve = []
        for p in pick_points(arms[arm]["checkpoints"], a.max_points, a.grid_s):
            r = serve(p["draft"], f"{arm}-{p['step']}")
            curve.append({**{k: p[k] for k in ("t_s", "step", "samples")}, **r})
            log(f"{arm} step {p['step']} at {p['t_s']:.0f} s: T=0 {r['T0']:.3f}, T=1 {r['T1']:.3f}")
        arms[arm]["curve"] = curve
    t_serve = time.perf_counter() - t_serve

    # -- compare -----------------------------------------------------------------------------------
    by_pair = {}
    for off, on in pairs:
        fo = arms[off]["curve"][-1]
        by_pair[on] = {
            "offline": off,
            "final": {x: {"wall_s": arms[x]["wall_s"], "T0": arms[x]["curve"][-1]["T0"],
                          "T1": arms[x]["curve"][-1]["T1"]} for x in (off, on)},  # fmt: skip
            "time_to_offline_final": {x: {t: R.time_to_reach(arms[x]["curve"], fo[t], t) for t in ("T0", "T1")}
                                      for x in (off, on)},  # fmt: skip
            "online_wall_s_saved_vs_offline": round(arms[off]["wall_s"] - arms[on]["wall_s"], 1),
        }
    comparison = {"by_pair": by_pair,
                  # the last pair's (balanced: the most epochs)
                  "online_wall_s_saved_vs_offline": by_pair[pairs[-1][1]]["online_wall_s_saved_vs_offline"]}  # fmt: skip
    checks = {}
    if regime == "fresh_replies":
        checks["same_prompts_offline_online"] = all(arms[x]["prompts_hash"] == want for x in arms)
    else:
        checks["same_samples_offline_online"] = all(arms[o]["samples_hash"] == arms[n]["samples_hash"] for o, n in pairs)
    checks.update({
        "same_held_out_documents": len({tuple(arms[x]["held_out_ids"]) for x in arms}) == 1,
        "points_per_curve_ge_min": all(len(arms[x]["curve"]) >= min_points for x in arms),
        "nothing_delivered_twice": all(arms[x]["delivered_twice"] == 0 for x in arms),
        "spool_empty_after_online_arms": all(arms[x].get("spool_files_left", 0) == 0 for x in arms),
        **R.regime_checks(regime, {"arms": arms, "pairs": pairs, **facts}),
    })  # fmt: skip
    result = {
        "benchmark": f"online_vs_offline_{regime}_cpu",
        "regime": regime,
        "smoke": a.smoke,
        "command": "python bench/online_vs_offline/online_vs_offline.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "trainer_threads": 1, "loadavg_at_end": os.getloadavg()},
        "split": split,
        "verifier": verifier,
        "verifier_layers": z.verifier_layers,
        "verifier_prepare_s": round(t_v, 1),
        "layers": layers,
        "samples": len(docs),
        "epochs": list(z.epochs),
        "grid_s": a.grid_s,
        "input_hash": hashlib.sha256(json.dumps(samples).encode()).hexdigest(),
        "train": {"lr": a.lr, "draft_vocab_size": a.draft_vocab_size, "eval_every": a.eval_every,
                  "eval_samples": a.eval_samples, "optimizer": "AdamW(0.9, 0.95)", "schedule": "cosine, warmup 20",
                  "samples_per_step": 1, "ttt_steps": 3, "seed": 0},  # fmt: skip
        "serving": {"num_speculative_tokens": 3, "prompts": len(eval_prompts), "max_tokens": a.max_tokens,
                    "wall_s": round(t_serve, 1)},  # fmt: skip
        "untrained": u,
        **extra,
        "arms": arms,
        "comparison": comparison,
        "checks": checks,
        "passed": all(checks.values()),
        "wall_s_total": round(time.perf_counter() - t_all, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = out.with_suffix(".png")
    try:
        plot_regime(result, png)
    except ImportError as e:  # matplotlib comes with the bench extra (make online-vs-offline installs it)
        if not a.smoke:
            raise
        log(f"no plot ({e}; pip install -e '.[bench]')")
    print(f"\n{'arm':<14}{'steps':>7}{'wall s':>8}{'disk MB':>9}{'spool MB':>9}{'pts':>5}{'T=0':>7}{'T=1':>7}")
    for arm, r in arms.items():
        print(f"{arm:<14}{r['steps']:>7}{r['wall_s']:>8.0f}{r['disk_peak_bytes']['data'] / 1e6:>9.1f}"
              f"{r.get('spool_peak_bytes_in_memory', 0) / 1e6:>9.1f}{len(r['curve']):>5}"
              f"{r['curve'][-1]['T0']:>7.3f}{r['curve'][-1]['T1']:>7.3f}")  # fmt: skip
    for k, ok in checks.items():
        print(f"{'ok    ' if ok else 'FAILED'} {k}")
    if a.smoke:
        est = R.estimate_wall_s(result, z, R.FULL[regime])
        print(f"estimated full run (--regime {regime}, {R.FULL[regime]}): ~{est / 60:.0f} min")
    log(f"-> {out}, {png} ({result['wall_s_total']:.0f} s)")
    return 0 if result["passed"] else 1


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=800, help="training documents")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of the offline and online arms")
    ap.add_argument("--grid-s", type=float, default=5.0, help="checkpoint every this many seconds of wall-clock")
    ap.add_argument("--max-points", type=int, default=10, help="served checkpoints per arm at most")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--draft-vocab-size", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=200, help="in-run held-out top-1 every N steps")
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--regen-max-tokens", type=int, default=64, help="reply length in the regenerated arm")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="few samples, 2 points per curve: checks the plumbing")
    ap.add_argument("--regime", choices=("default", "balanced", "disk_limited", "fresh_replies"), default="default",
                    help="default: the three arms above; the others: bench/online_vs_offline/ovo_regimes.py (their own sizes)")
    ap.add_argument("--verifier-layers", type=int, default=None,
                    help="regimes: the verifier's depth (identity-padded), instead of the regime's")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--train-child", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.train_child:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        res = train_child(json.loads(Path(a.train_child[0]).read_text()))
        Path(a.train_child[1]).write_text(json.dumps(res))
        return 0
    if a.regime != "default":
        return main_regime(a)
    if a.smoke:
        a.samples, a.epochs, a.grid_s, a.max_points = 60, 2, 5.0, 3
        a.eval_every, a.eval_samples, a.eval_prompts, a.max_tokens, a.regen_max_tokens = 20, 4, 4, 16, 32
    name = "online_vs_offline_cpu" + ("_smoke" if a.smoke else "")
    out = Path(a.out or ROOT / "bench" / "results" / f"{name}.json")
    min_points = 2 if a.smoke else 4

    from hsstream import launch
    from hsstream import pretrain_verifier as PV
    from trainer_client.train import vocab as V

    t_all = time.perf_counter()
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="hsstream-ovo-"))
    wd.mkdir(parents=True, exist_ok=True)
    log(f"workdir {wd}")
    verifier = str(PV.pretrained_verifier())
    docs = PV.corpus_documents(a.samples, PV.SEED_DRAFT_TRAIN)
    samples = [{"id": f"doc-{i}", "prompt": d} for i, d in enumerate(docs)]
    # One draft vocabulary for every arm: the documents' token counts (same maps, same draft config).
    counts = wd / "token_counts.json"
    V.save_token_counts(V.token_counts_from_samples(verifier, samples, "all"), counts)
    # Regenerated arm: prompts cut from the same documents (as bench/served_acceptance/acceptance.py cuts them), the
    # verifier writes the replies; half greedy, half sampled, one pass.
    import random

    rng = random.Random(PV.SEED_DRAFT_TRAIN + 1)
    prompts = [d[: rng.randint(min(40, len(d) - 1), min(200, len(d) - 1))] for d in docs]
    half = len(prompts) // 2
    regen_jobs = [
        ([{"id": f"doc-{i}", "prompt": p} for i, p in enumerate(part, start=off)],
         {"mode": "regenerate", "loss_mask": "all", "sampling": {"max_tokens": a.regen_max_tokens, "temperature": temp,
                                                                "seed": 7}})
        for off, temp, part in ((0, 0.0, prompts[:half]), (half, 1.0, prompts[half:]))
    ]  # fmt: skip
    bind = launch.cpu_env().get("VLLM_CPU_OMP_THREADS_BIND", "n/a") if launch.is_cpu_build() else "cuda"
    import torch

    from trainer_client.train.trainer import token_digest

    regen_samples = [x for part, _ in regen_jobs for x in part]
    regen_ids = V.tokenize_samples(verifier, regen_samples, "all", mode="regenerate")  # as the sidecar does
    assert len(regen_ids) == len(regen_samples), "the sidecar would refuse some regenerated prompts"
    want_prompts = prompts_hash({(x["id"], token_digest(torch.tensor(ids))) for x, (ids, _) in zip(regen_samples, regen_ids)})

    arms: dict[str, dict] = {}
    arms["offline"] = arm_offline(a, verifier, docs, counts, wd)
    log(f"offline: final checkpoint at {arms['offline']['wall_s']:.0f} s")
    steps = (len(docs) - a.eval_samples) * a.epochs
    arms["online"] = arm_online(a, verifier, [(samples, {"loss_mask": "all", "epochs": a.epochs})], counts, wd,
                                "online", steps)  # fmt: skip
    log(f"online: final checkpoint at {arms['online']['wall_s']:.0f} s")
    arms["online_regenerated"] = arm_online(a, verifier, regen_jobs, counts, wd, "online_regenerated",
                                            len(docs) - a.eval_samples)  # fmt: skip
    log(f"online, regenerated: final checkpoint at {arms['online_regenerated']['wall_s']:.0f} s")

    # -- serve: the untrained draft once, then each arm's checkpoints ---------------------------
    import torch

    from trainer_client.drafts import eagle3 as E3

    eval_prompts = PV.held_out_prompts(a.eval_prompts)
    run0 = wd / "offline" / "run"
    maps = torch.load(run0 / "vocab_maps.pt", weights_only=True)
    untrained = E3.build_draft(verifier, LAYERS[:3], draft_vocab_size=maps["draft_vocab_size"], t2d=maps["t2d"],
                              d2t=maps["d2t"], seed=0)  # fmt: skip
    untrained.save_pretrained(wd / "untrained-draft")
    for arm in ARMS[1:]:  # same maps in every arm (one token-count file): checked, not assumed
        other = torch.load(wd / arm / "run" / "vocab_maps.pt", weights_only=True)
        assert torch.equal(other["t2d"], maps["t2d"]) and torch.equal(other["d2t"], maps["d2t"]), arm

    def serve(draft: str, tag: str) -> dict:
        r = run_serving(verifier, draft, eval_prompts, a.max_tokens, [0.0, 1.0], wd, tag)
        return {"T0": r["0.0"]["acceptance_rate"] or 0.0, "T1": r["1.0"]["acceptance_rate"] or 0.0,
                "engine_wall_s": r["engine_wall_s"]}  # fmt: skip

    t_serve = time.perf_counter()
    u = serve(str(wd / "untrained-draft"), "untrained")
    log(f"untrained draft: T=0 {u['T0']:.3f}, T=1 {u['T1']:.3f}")
    for arm in ARMS:
        curve = []
        for p in pick_points(arms[arm]["checkpoints"], a.max_points, a.grid_s):
            r = serve(p["draft"], f"{arm}-{p['step']}")
            curve.append({**{k: p[k] for k in ("t_s", "step", "samples")}, **r})
            log(f"{arm} step {p['step']} at {p['t_s']:.0f} s: T=0 {r['T0']:.3f}, T=1 {r['T1']:.3f}")
        arms[arm]["curve"] = curve
    t_serve = time.perf_counter() - t_serve

    # -- compare ---------------------------------------------------------------------------------
    off, on, rg = arms["offline"], arms["online"], arms["online_regenerated"]
    first_off = off["curve"][0]
    on_then = at_time(on["curve"], first_off["t_s"])
    rg_then = at_time(rg["curve"], first_off["t_s"])
    final = {arm: arms[arm]["curve"][-1] for arm in ARMS}
    comparison = {
        "offline_first_checkpoint": first_off,
        "online_at_that_time": on_then,
        "online_regenerated_at_that_time": rg_then,
        "online_minus_offline_at_that_time": {t: round(on_then[t] - first_off[t], 4) for t in ("T0", "T1")}
        if on_then else None,
        "final": {arm: {"wall_s": arms[arm]["wall_s"], "T0": final[arm]["T0"], "T1": final[arm]["T1"]} for arm in ARMS},
        "online_wall_s_saved_vs_offline": round(off["wall_s"] - on["wall_s"], 1),
    }
    checks = {
        "same_samples_offline_online": off["samples_hash"] == on["samples_hash"],
        # what the regenerated arm's trainer received began with the documents' prompts, as cut
        "regenerated_prompts_are_the_documents": rg["prompts_hash"] == want_prompts,
        "same_held_out_documents": len({tuple(arms[arm]["held_out_ids"]) for arm in ARMS}) == 1,
        "points_per_curve_ge_min": all(len(arms[arm]["curve"]) >= min_points for arm in ARMS),
        "nothing_delivered_twice": all(arms[arm]["delivered_twice"] == 0 for arm in ARMS),
        "spool_empty_after_online_arms": on["spool_files_left"] == 0 and rg["spool_files_left"] == 0,
    }
    result = {
        "benchmark": "online_vs_offline_cpu",
        "command": "python bench/online_vs_offline/online_vs_offline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "vllm_cpu_threads_bind": bind, "trainer_threads": 1,
                    "loadavg_at_end": os.getloadavg()},  # fmt: skip
        "verifier": verifier,
        "samples": len(docs),
        "epochs": a.epochs,
        "grid_s": a.grid_s,
        "input_hash": hashlib.sha256(json.dumps(samples).encode()).hexdigest(),
        "regenerated_prompts_hash": want_prompts,
        "train": {"lr": a.lr, "draft_vocab_size": a.draft_vocab_size, "eval_every": a.eval_every,
                  "eval_samples": a.eval_samples, "optimizer": "AdamW(0.9, 0.95)", "schedule": "cosine, warmup 20",
                  "samples_per_step": 1, "ttt_steps": 3},  # fmt: skip
        "serving": {"num_speculative_tokens": 3, "prompts": len(eval_prompts), "max_tokens": a.max_tokens,
                    "wall_s": round(t_serve, 1)},  # fmt: skip
        "untrained": u,
        "arms": arms,
        "comparison": comparison,
        "checks": checks,
        "passed": all(checks.values()),
        "wall_s_total": round(time.perf_counter() - t_all, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(result, png)

    print(f"\n{'arm':<20}{'wall s':>8}{'disk MB':>9}{'points':>7}{'T=0 final':>10}{'T=1 final':>10}  samples hash")
    for arm in ARMS:
        r = arms[arm]
        print(f"{arm:<20}{r['wall_s']:>8.0f}{r['disk_peak_bytes']['total'] / 1e6:>9.1f}{len(r['curve']):>7}"
              f"{final[arm]['T0']:>10.3f}{final[arm]['T1']:>10.3f}  {r['samples_hash'][:12]}")  # fmt: skip
    print(f"\n{'t (s)':>7}" + "".join(f"{arm + ' T0/T1':>28}" for arm in ARMS))
    times = sorted({p["t_s"] for arm in ARMS for p in arms[arm]["curve"]})
    for t in times:
        cells = []
        for arm in ARMS:
            p = at_time(arms[arm]["curve"], t)
            cells.append(f"{p['T0']:.3f}/{p['T1']:.3f}" if p else "-")
        print(f"{t:>7.0f}" + "".join(f"{c:>28}" for c in cells))
    if on_then:
        print(f"\nat {first_off['t_s']:.0f} s (offline's first checkpoint): offline {first_off['T0']:.3f}/{first_off['T1']:.3f}, "
              f"online {on_then['T0']:.3f}/{on_then['T1']:.3f} (T=0/T=1)")  # fmt: skip
    for k, ok in checks.items():
        if not ok:
            print(f"FAILED: {k}")
    log(f"-> {out}, {png} ({result['wall_s_total']:.0f} s)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
