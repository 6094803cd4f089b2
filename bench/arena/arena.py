#!/usr/bin/env python3
"""Issue 26's measurement: the arena spool layout beside files, the same run, arms interleaved.

Three full stacks stay up for the whole run, one per arm, each with its own spool on /dev/shm,
run dir, ledger and ports: ``files`` and ``arena`` (``HSSTREAM_SPOOL_LAYOUT``, the stream's
defaults: a slot read in place is trusted without a checksum, its lease keeps other writers out)
and ``arena_verified`` (the arena with the stream's ``verify_slots``: every slot checksummed, as
every file is), so what the trust saves is measured beside the rest:

* a stand-in for vLLM (a bare ASGI app under uvicorn, as in ``bench/costs/sidecar_throughput.py``)
  that runs the connector's REAL code for every ``/v1/completions``: ``SchedulerSide`` turns the
  request (its ``kv_transfer_params`` tag, which carries the slot in the arena arm) into a
  ``PendingSave``; an engine thread hands it to ``WorkerSide.step``, whose ``HiddenStateGatherer``
  gathers the rows out of a CPU "KV cache" laid out as vLLM 0.30+ hands it over (physical
  ``[blocks, block_size, K, H]``, seen as ``[blocks, K, block_size, H]``), and a ``SpoolWriter``
  checksums, writes the file or the slot and pushes the notice on its writer threads. Real vLLM
  cannot make 1,024-token samples of the Qwen3-8B shape on 2 cores; this is what the connector
  does with them once the forward is done. The HTTP answer goes at once (the write follows);
* the real sidecar (``python -m hsstream serve``), its ``HSSTREAM_MODEL`` a config-only folder of
  Qwen3-8B's shape so it prices samples (4 layers x 4096 hidden, bf16: 33.5 MB per sample), a
  spool budget of ``--budget-samples`` samples;
* the trainer: a ``HiddenStateStream`` in THIS process (the CPU trainer's defaults: pin_memory
  off, its check workers), which touches each sample's tensors and drops them.

Each round runs, per arm (arms alternate, the order flipped every round, after one warm-up
round per arm):

1. a paced job (``--pace-ms``): the stand-in's engine starts one sample per interval, longer
   than the whole pipeline takes, so each sample crosses an idle pipeline: notice -> tensor
   (the yield, minus the notice's ``sent_at`` stamped by the connector's writer) is the hop
   itself. ``p50_ms`` / ``p99_ms`` are these (pooled over the rounds);
2. a saturated job (``--samples``, ``HSSTREAM_MAX_CONCURRENCY`` requests in flight, so the
   stand-in always has work): samples/s (samples / (last yield - job submitted)), CPU ms per
   sample of each process (``psutil`` user+system deltas over the job / samples: stand-in =
   connector, sidecar, this process = stream), bytes copied per sample (the deltas of the
   counters in the code that copies: the connector's ``SpoolWriter.stats["bytes_copied"]``, read
   from the stand-in's ``GET /bench/stats``, and the stream's ``stats["bytes_copied"]``), and
   notice -> tensor under load (``saturated``).

Then ``--tiny`` (on by default; ``--no-tiny`` leaves it out): the same two layouts through real
vLLM (CPU) on the tiny verifier, two ``hsstream.devstack.Stack`` s, interleaved rounds of small
jobs. There the connector runs inside vLLM, whose counters this bench cannot read: its bytes
copied are the stream's only, and "connector" CPU is vLLM's whole process tree (the forward
included).

    python bench/arena/arena.py                       # writes bench/results/arena_cpu.json
    python bench/arena/arena.py --quick --out /tmp/arena.json   # smoke: few samples, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import cpu_model  # noqa: E402
from bench.common import pctl, window_bounds  # noqa: E402

#: The arena arm trusts slots (the stream's default); ``arena_verified`` is the same layout with
#: the stream's ``verify_slots`` on (a checksum of every slot, as files always take): what that
#: pass costs, side by side.
ARMS = ("files", "arena", "arena_verified")
#: Qwen3-8B: 36 layers, 4096 hidden, bf16; the launcher's default layers [2, 18, 33, 36].
QWEN3_8B = {"num_hidden_layers": 36, "hidden_size": 4096, "torch_dtype": "bfloat16"}
LAYER_IDS = [2, 18, 33, 36]
TOKENS = 1024
BLOCK_SIZE = 16
#: Requests' worth of blocks in the stand-in's cache (they are reused round-robin: never written).
CACHE_REQUESTS = 4
MODEL_NAME = "stand-in-qwen3-8b"
TINY_LAYER_IDS = [2, 6, 9, 12]


# ---------------------------------------------------------------------------------- pure logic


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


#: Latency is given over every sample, over each job's steady-state window (samples yielded
#: between the 10th and the 90th percentile of the job's yield times, as bench/online_gpu/online_gpu.py's)
#: and over each job's first samples (its start).
WINDOW = (0.10, 0.90)
FIRST = 32


def three(xs: list[float]) -> dict:
    return {"p50_ms": _r(pctl(xs, 0.5)), "p99_ms": _r(pctl(xs, 0.99)), "max_ms": _r(max(xs) if xs else None),
            "n": len(xs)}  # fmt: skip


def window_of(lat: list[float], yield_s: list[float]) -> list[float]:
    """The latencies of the samples yielded within the job's :data:`WINDOW` of yield times."""
    if not yield_s:
        return []
    lo, hi = window_bounds(yield_s, *WINDOW)
    return [v for v, t in zip(lat, yield_s, strict=True) if lo <= t <= hi]


def latency_views(jobs: list[tuple[list[float], list[float]]]) -> dict:
    """(latencies in notice order, their yield times) of several jobs -> every sample's
    figures (``all``), the jobs' steady-state windows' (``window``), and each job's first
    :data:`FIRST` samples' p99 (``first_32_p99_ms``, one per job)."""
    return {"all": three([v for lat, _ in jobs for v in lat]),
            "window": three([v for lat, ys in jobs for v in window_of(lat, ys)]),
            f"first_{FIRST}_p99_ms": [_r(pctl(lat[:FIRST], 0.99)) for lat, _ in jobs]}  # fmt: skip


def summarize_arm(rounds: list[dict]) -> dict:
    """One arm's figures from its measured rounds (each as :meth:`Arm.run_round` returns it):
    latency percentiles pooled over the rounds' samples, the rest the median over rounds."""
    lat = [x for r in rounds for x in r["latency_ms"]]
    sat = [x for r in rounds for x in r["saturated"]["latency_ms"]]
    procs = sorted({p for r in rounds for p in r["saturated"]["cpu_s"]})
    cpu = {p: _r(_med([1000 * r["saturated"]["cpu_s"][p] / r["saturated"]["samples"] for r in rounds])) for p in procs}
    cpu["total"] = _r(_med([1000 * sum(r["saturated"]["cpu_s"].values()) / r["saturated"]["samples"] for r in rounds]))
    sides = sorted({p for r in rounds for p in r["saturated"]["bytes_copied"]})
    copied: dict[str, float | None] = {}
    for p in sides:
        vals = [r["saturated"]["bytes_copied"].get(p) for r in rounds]
        copied[p] = None if any(v is None for v in vals) else _r(_med([v / r["saturated"]["samples"]
                                                                        for v, r in zip(vals, rounds)]), 1)  # fmt: skip
    copied["total"] = None if not sides or any(v is None for v in copied.values()) else _r(sum(copied.values()), 1)
    return {
        "rounds": len(rounds),
        "p50_ms": _r(pctl(lat, 0.5)), "p99_ms": _r(pctl(lat, 0.99)), "latency_samples": len(lat),
        "cpu_ms_per_sample": cpu,
        "bytes_copied_per_sample": copied,
        "samples_per_s": _r(_med([r["saturated"]["samples_per_s"] for r in rounds]), 2),
        "saturated": {"p50_ms": _r(pctl(sat, 0.5)), "p99_ms": _r(pctl(sat, 0.99)), "latency_samples": len(sat),
                      **latency_views([(r["saturated"]["latency_ms"], r["saturated"].get("yield_s") or [])
                                       for r in rounds])},
        # p50_ms / p99_ms above: over every sample of the paced jobs; here also their max, their
        # steady-state windows and each job's start
        **latency_views([(r["latency_ms"], r.get("yield_s") or []) for r in rounds]),
        "hop_p50_ms": {k: _r(pctl([x for r in rounds for x in r["hops_ms"].get(k, [])], 0.5))
                       for k in sorted({k for r in rounds for k in r["hops_ms"]})},
        "p50_ms_per_round": [_r(pctl(r["latency_ms"], 0.5)) for r in rounds],
        "samples_per_s_per_round": [r["saturated"]["samples_per_s"] for r in rounds],
    }  # fmt: skip


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 4)


def compare(files: dict, arena: dict, max_p50_ratio: float = 0.6) -> tuple[dict, dict]:
    """(arena ÷ files for each figure, the acceptance checks) for two :func:`summarize_arm` s."""
    r = {
        "p50": ratio(arena["p50_ms"], files["p50_ms"]),
        "p99": ratio(arena["p99_ms"], files["p99_ms"]),
        "saturated_p50": ratio(arena["saturated"]["p50_ms"], files["saturated"]["p50_ms"]),
        "cpu_ms_per_sample": {p: ratio(arena["cpu_ms_per_sample"].get(p), v)
                              for p, v in files["cpu_ms_per_sample"].items()},
        "bytes_copied_per_sample": {p: ratio(arena["bytes_copied_per_sample"].get(p), v)
                                    for p, v in files["bytes_copied_per_sample"].items()},
        "samples_per_s": ratio(arena["samples_per_s"], files["samples_per_s"]),
    }  # fmt: skip
    fb, ab = files["bytes_copied_per_sample"].get("total"), arena["bytes_copied_per_sample"].get("total")
    checks = {
        f"p50_ratio_le_{max_p50_ratio}": r["p50"] is not None and r["p50"] <= max_p50_ratio,
        "fewer_bytes_copied": fb is not None and ab is not None and ab < fb,
    }
    return r, checks


# ---------------------------------------------------------------------------------- helpers
def sample_file_bytes(tokens: int = TOKENS) -> int:
    from connector import protocol as P
    from connector.contract import arena as A

    return A.round_up(P.expected_file_bytes(tokens, len(LAYER_IDS), QWEN3_8B["hidden_size"], 2))


def write_model_config(d: Path) -> Path:
    """A config-only verifier folder of Qwen3-8B's shape: the sidecar prices samples from it. No
    ``model_type``: transformers would then make an empty tokenizer of it (vocabulary 0, every
    token id refused); without one it finds none and the sidecar admits token ids unchecked."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {**QWEN3_8B, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def cpu_s(pid: int | None = None, tree: bool = False) -> float:
    import psutil

    p = psutil.Process(pid)
    procs = [p, *(p.children(recursive=True) if tree else [])]
    tot = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
        except psutil.NoSuchProcess:
            continue
        tot += t.user + t.system
    return tot


def touch(x) -> float:  # noqa: ANN001
    """What a trainer's first use costs, at least: read a few values of each tensor."""
    hs = x.hidden_states
    return float(hs[0, 0, :8].float().sum()) + float(hs[-1, -1, -8:].float().sum()) + int(x.token_ids[-1])


def hops(x, out: dict[str, list[float]]) -> float | None:  # noqa: ANN001
    """Notice -> tensor (ms) of one yielded sample, and its parts into ``out``: ``sidecar_in``
    (to the sidecar's notice socket), ``sidecar_queue`` (ledger, credit, lease, send),
    ``to_trainer`` (on to the stream's socket), ``read_check`` (received -> checked: the read
    or the mapping, checksum, finiteness; ``read``, ``checksum``, ``finite``: those phases as the
    stream times them) and ``to_loop`` (checked -> yielded)."""
    from connector import protocol as P

    n, t = x.notice, x.timings
    if n is None or n.sent_at is None or "handed" not in t:
        return None
    total = 1000 * (t["handed"] - n.sent_at)
    if "received" in t and {P.TIMING_SIDECAR_IN, P.TIMING_SIDECAR_QUEUE} <= set(n.timings):
        sin, sq = n.timings[P.TIMING_SIDECAR_IN], n.timings[P.TIMING_SIDECAR_QUEUE]
        out.setdefault("sidecar_in", []).append(1000 * sin)
        out.setdefault("sidecar_queue", []).append(1000 * sq)
        out.setdefault("to_trainer", []).append(1000 * (t["received"] - n.sent_at - sin - sq))
    if "received" in t and "checked" in t:
        out.setdefault("read_check", []).append(1000 * (t["checked"] - t["received"]))
        out.setdefault("to_loop", []).append(1000 * (t["handed"] - t["checked"]))
    for phase in ("read_s", "checksum_s", "finite_s"):  # the stream's own phases within read_check
        if phase in t:
            out.setdefault(phase.removesuffix("_s"), []).append(1000 * t[phase])
    return total


# ---------------------------------------------------------------------------------- stand-in
class StandIn:
    """The connector's real parts as vLLM's processes hold them, on a CPU cache: the scheduler
    side (request -> ``PendingSave`` and the answer's ``kv_transfer_params``), and the worker
    side with its gatherer and ``SpoolWriter`` (gather, checksum, file or slot, notice), driven by
    :meth:`engine`, a loop of steps as vLLM's worker runs them. The cache holds ``cache_requests``
    requests' worth of blocks, handed out round-robin in a scattered order (never written: the
    values stay finite for the trainer's checks)."""

    def __init__(self, spool: str, notice_ep: str | None, *, layer_ids: list[int] = LAYER_IDS,
                 num_hidden_layers: int = QWEN3_8B["num_hidden_layers"], hidden: int = QWEN3_8B["hidden_size"],
                 tokens: int = TOKENS, block_size: int = BLOCK_SIZE, cache_requests: int = CACHE_REQUESTS) -> None:  # fmt: skip
        import queue

        import torch

        from connector.contract.settings import Settings
        from connector.layers import storage_permutation
        from connector.scheduler_side import SchedulerSide
        from connector.spool_writer import ShapeInfo, SpoolWriter
        from connector.worker_side import HiddenStateGatherer, WorkerSide

        env = Settings()
        k = len(layer_ids)
        self.block_size = block_size
        self.nblocks = cache_requests * -(-tokens // block_size)
        g = torch.Generator().manual_seed(0)
        phys = torch.empty((self.nblocks, block_size, k, hidden), dtype=torch.bfloat16)
        for b in range(self.nblocks):  # a block at a time: no float32 copy of the whole cache
            phys[b] = torch.randn((block_size, k, hidden), generator=g)
        self.cache = phys
        kv = phys.permute(0, 2, 1, 3)  # vLLM 0.30+ hands the cache over as [blocks, K, block_size, H]
        self.order = torch.randperm(self.nblocks, generator=g).tolist()  # a request's blocks are scattered
        self.writer = SpoolWriter(spool, notice_ep, ShapeInfo(list(layer_ids), num_hidden_layers, hidden, "bfloat16",
                                                              MODEL_NAME),
                                  num_threads=env.num_writer_threads, max_pending_bytes=env.max_pending_write_bytes,
                                  max_queued_notices=env.max_queued_notices, checksum_algo=env.checksum,
                                  checksum_threads=env.checksum_threads)  # fmt: skip
        self.worker = WorkerSide(HiddenStateGatherer(kv, block_size, k, storage_permutation(layer_ids), self.writer),
                                 self.writer)  # fmt: skip
        self.sched = SchedulerSide(spool, allow_custom_save_path=False, use_lock=True)
        self.switch_interval_ms = env.switch_interval_ms
        self.todo: queue.Queue = queue.Queue()
        self.pace_s = 0.0
        self.steps = 0
        self._next = 0

    def complete(self, req: dict) -> dict:
        """A ``/v1/completions`` request, finished at once (its forward is not ours to run): the
        scheduler side's part, its save queued for the engine; returns the answer's body."""
        import uuid
        from types import SimpleNamespace

        ids = [int(t) for t in req["prompt"]]
        rid = f"cmpl-{uuid.uuid4().hex}-0"
        request = SimpleNamespace(request_id=rid, kv_transfer_params=req.get("kv_transfer_params"),
                                  prompt_token_ids=ids, all_token_ids=[*ids, 0], num_computed_tokens=len(ids),
                                  status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))  # fmt: skip
        need, at = -(-len(ids) // self.block_size), self._next
        self._next = (at + need) % self.nblocks
        self.sched.request_scheduled(request)
        _, params = self.sched.request_finished(request, [self.order[(at + i) % self.nblocks] for i in range(need)])
        for p in self.sched.take_pending():
            self.todo.put(p)
        return {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": "x"}],
                "kv_transfer_params": params}  # fmt: skip

    def engine(self) -> None:
        """vLLM's worker loop reduced to the connector's part: each step takes every save queued
        since the last (paced: one, ``pace_s`` after the last step); None in the queue stops it."""
        import queue

        last = 0.0
        while True:
            items = [self.todo.get()]
            if items[0] is None:
                return
            if self.pace_s:
                time.sleep(max(0.0, last + self.pace_s - time.monotonic()))
            else:
                while True:
                    try:
                        items.append(self.todo.get_nowait())
                    except queue.Empty:
                        break
                if items[-1] is None:
                    items.pop()
                    self.todo.put(None)
            last = time.monotonic()
            self.worker.step_starts()
            self.worker.step(items, {p.request_id for p in items})
            self.steps += 1

    def stats(self) -> dict:
        return {"writer": self.writer.stats_snapshot(), "steps": self.steps, "queued": self.todo.qsize()}

    def close(self) -> None:
        self.todo.put(None)
        self.writer.flush(30)
        self.writer.close()


def stand_in(port: int, spool: str, notice_ep: str) -> None:
    """The vLLM stand-in (its own process): :class:`StandIn` behind a bare ASGI app; each
    completion is answered at once, its write follows on the writer threads."""
    import threading

    import uvicorn

    from bench.costs.sidecar_throughput import read_body
    from connector.contract.settings import lower_switch_interval

    si = StandIn(spool, notice_ep)
    lower_switch_interval(si.switch_interval_ms)  # as the plug-in does beside vLLM's loop
    threading.Thread(target=si.engine, name="engine", daemon=True).start()
    models = json.dumps({"data": [{"id": MODEL_NAME, "max_model_len": 4 * TOKENS}]}).encode()

    async def app(scope, receive, send):  # noqa: ANN001, ANN202
        if scope["type"] != "http":
            return  # lifespan: unsupported, uvicorn goes on without it
        body = await read_body(receive)
        out, path = models, scope["path"]
        if path == "/v1/completions":
            out = json.dumps(si.complete(json.loads(body))).encode()
        elif path == "/bench/stats":
            out = json.dumps(si.stats()).encode()
        elif path == "/bench/pace":
            si.pace_s = float(json.loads(body)["ms"]) / 1000
            out = b"{}"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})

    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        si.close()


# ---------------------------------------------------------------------------------- one arm
class Arm:
    """One layout's stack: the sidecar and the stand-in, up for the whole run."""

    def __init__(self, name: str, a: argparse.Namespace, model_dir: Path) -> None:
        from hsstream.devstack import free_port

        self.name = name
        layout = self.layout = "arena" if name.startswith("arena") else "files"
        self.verify_slots = name == "arena_verified"
        self.spool = Path(tempfile.mkdtemp(prefix=f"hsstream-arena-bench-{layout}-", dir=a.spool_parent))
        self.run = Path(tempfile.mkdtemp(prefix=f"hsstream-arena-bench-{layout}-run-"))
        self.vport, self.aport = free_port(), free_port()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "HSSTREAM_SPOOL_DIR": str(self.spool),
                    "HSSTREAM_RUN_DIR": str(self.run), "HSSTREAM_LEDGER_PATH": str(self.run / "ledger.sqlite"),
                    "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{self.vport}", "HSSTREAM_PORT": str(self.aport),
                    "HSSTREAM_MODEL": str(model_dir), "HSSTREAM_LAYER_IDS": ",".join(map(str, LAYER_IDS)),
                    "HSSTREAM_MAX_CONCURRENCY": str(a.concurrency), "HSSTREAM_LOG_LEVEL": "warning",
                    "HSSTREAM_SPOOL_BUDGET_BYTES": str(a.budget_samples * sample_file_bytes()),
                    "HSSTREAM_SPOOL_LAYOUT": layout,
                    "HSSTREAM_API_TOKEN": secrets.token_hex(16)}  # fmt: skip
        self.procs: list[subprocess.Popen] = []
        self.a = a
        self.rest = None

    @property
    def vllm(self) -> str:
        return f"http://127.0.0.1:{self.vport}"

    def start(self) -> None:
        import httpx

        from connector.contract.rest_client import SidecarClient, SidecarError

        log = open(self.run / "sidecar.log", "w")  # noqa: SIM115
        self.sidecar = subprocess.Popen([sys.executable, "-m", "hsstream", "serve"], env=self.env, stdout=log,
                                        stderr=log, cwd=ROOT, start_new_session=True)  # fmt: skip
        self.procs.append(self.sidecar)
        self.rest = SidecarClient(f"http://127.0.0.1:{self.aport}", token=self.env["HSSTREAM_API_TOKEN"], timeout=120)
        for _ in range(600):
            try:
                self.rest.healthz()
                break
            except SidecarError:
                if self.sidecar.poll() is not None:
                    tail = (self.run / "sidecar.log").read_text()[-2000:]
                    raise RuntimeError(f"{self.layout} sidecar exited: {tail}")
                time.sleep(0.1)
        slog = open(self.run / "stand_in.log", "w")  # noqa: SIM115
        self.stand_in = subprocess.Popen(
            [sys.executable, __file__, "--stand-in", str(self.vport), str(self.spool), f"ipc://{self.run}/notice.sock"],
            env=self.env, stdout=slog, stderr=slog, cwd=ROOT, start_new_session=True)  # fmt: skip
        self.procs.append(self.stand_in)
        for _ in range(1200):
            try:
                httpx.get(f"{self.vllm}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                if self.stand_in.poll() is not None:
                    tail = (self.run / "stand_in.log").read_text()[-2000:]
                    raise RuntimeError(f"{self.layout} stand-in exited: {tail}")
                time.sleep(0.1)

    def bench_get(self, path: str) -> dict:
        import httpx

        return httpx.get(f"{self.vllm}{path}", timeout=10).json()

    def pace(self, ms: float) -> None:
        import httpx

        httpx.post(f"{self.vllm}/bench/pace", json={"ms": ms}, timeout=10).raise_for_status()

    def job(self, n: int, seed: int) -> dict:
        """One job of ``n`` samples through this stack; per-sample latencies and the job's figures."""
        import random

        from trainer_client import HiddenStateStream

        rng = random.Random(seed)
        samples = [{"token_ids": [rng.randrange(1, 151_000) for _ in range(TOKENS)]} for _ in range(n)]
        w0 = self.bench_get("/bench/stats")["writer"]
        cpu0 = {"connector": cpu_s(self.stand_in.pid), "sidecar": cpu_s(self.sidecar.pid), "stream": cpu_s()}
        t0 = time.perf_counter()
        job = self.rest.create_job(samples).job_id
        got: list[tuple[float, float, float]] = []  # (notice sent_at, yielded s after submission, ms)
        hop: dict[str, list[float]] = {}
        t_last, acc, slots = t0, 0.0, 0
        with HiddenStateStream(f"ipc://{self.run}/delivery.sock", jobs=[job], spool_dir=self.spool,
                               credit=self.a.credit, verify_slots=self.verify_slots,
                               pin_memory=False, timeout_s=120) as s:  # fmt: skip
            for x in s:
                acc += touch(x)
                slots += x.notice is not None and x.notice.slot is not None
                t_last = time.perf_counter()
                if (ms := hops(x, hop)) is not None:
                    got.append((x.notice.sent_at, t_last - t0, ms))
                del x  # the arena: a slot is freed once no view of it is left
            stream_stats = dict(s.stats)
        got.sort()  # notice order: a job's first samples first
        cpu1 = {"connector": cpu_s(self.stand_in.pid), "sidecar": cpu_s(self.sidecar.pid), "stream": cpu_s()}
        w1 = self.bench_get("/bench/stats")["writer"]
        st = self.rest.job(job)
        copied_c = (w1["bytes_copied"] - w0.get("bytes_copied", 0)) if "bytes_copied" in w1 else None
        return {
            "samples": n, "yielded": stream_stats.get("yielded"), "from_slots": slots,
            "latency_ms": [round(v, 3) for _, _, v in got], "yield_s": [round(t, 4) for _, t, _ in got],
            "hops_ms": {k: [round(v, 3) for v in vs] for k, vs in hop.items()},
            "consumed": st.counts.get("consumed"), "failed": st.counts.get("failed"),
            "samples_per_s": round(n / (t_last - t0), 2), "seconds": round(t_last - t0, 3),
            "cpu_s": {p: round(cpu1[p] - cpu0[p], 4) for p in cpu0},
            "bytes_copied": {"connector": copied_c, "stream": stream_stats.get("bytes_copied")},
            "stream_stats": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stream_stats.items()},
            "writer_busy": w1.get("busy", 0) - w0.get("busy", 0),
        }  # fmt: skip

    def run_round(self, r: int, a: argparse.Namespace) -> dict:
        out: dict[str, Any] = {"arm": self.name, "round": r, "load_avg_1": round(os.getloadavg()[0], 2)}
        if a.pace_ms > 0 and a.paced_samples > 0:
            self.pace(a.pace_ms)
            try:
                paced = self.job(a.paced_samples, seed=1000 + r)
            finally:
                self.pace(0)
            out.update(latency_ms=paced["latency_ms"], yield_s=paced["yield_s"], hops_ms=paced["hops_ms"],
                       paced={k: v for k, v in paced.items() if k not in ("latency_ms", "yield_s", "hops_ms")})  # fmt: skip
        sat = self.job(a.samples, seed=r)
        if "latency_ms" not in out:  # no paced job: the saturated job's latencies stand for it
            out.update(latency_ms=sat["latency_ms"], yield_s=sat["yield_s"], hops_ms=sat["hops_ms"])
        out["saturated"] = sat
        return out

    def stop(self) -> None:
        if self.rest is not None:
            self.rest.close()
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        shutil.rmtree(self.spool, ignore_errors=True)
        shutil.rmtree(self.run, ignore_errors=True)


def spool_left(spool: Path) -> list[str]:
    """Sample files (and temporary files) left in a spool; the arena's own file and the sidecar's
    lock are not (the lock made every run here read "left" once the sidecar held one)."""
    from connector.contract.spool import leftover_entries

    return leftover_entries(spool)


def lean(r: dict) -> dict:
    """A round for the JSON's detail: without its per-sample lists (the summaries hold them)."""
    return {k: (lean(v) if isinstance(v, dict) else v) for k, v in r.items()
            if k not in ("latency_ms", "yield_s", "hops_ms")}


def ok_round(r: dict) -> bool:
    """Every sample of the round's jobs consumed and yielded, none failed, and each from its arm's
    layout (the arena arm's all from slots, the files arm's none): an arena arm that quietly fell
    back to files would measure files twice."""
    jobs = [r["saturated"], *([r["paced"]] if "paced" in r else [])]
    layout_ok = all(j.get("from_slots", 0) == (j["samples"] if str(r.get("arm")).startswith("arena") else 0) for j in jobs)
    return layout_ok and all(j["consumed"] == j["samples"] and not j["failed"] and j["yielded"] == j["samples"]
                             for j in jobs)  # fmt: skip


def print_table(title: str, arms: dict[str, dict], ratios: dict) -> None:
    print(f"\n{title}")
    print("| arm | notice->tensor p50 ms | p99 ms | saturated p50 ms | samples/s | CPU ms/sample "
          "(connector / sidecar / stream = total) | bytes copied/sample (connector + stream = total) |")
    print("|---|---|---|---|---|---|---|")
    for name, s in arms.items():
        c, b = s["cpu_ms_per_sample"], s["bytes_copied_per_sample"]

        def mb(v: float | None) -> str:
            return "n/a" if v is None else f"{v / 1e6:.1f} MB"

        print(f"| {name} | {s['p50_ms']} | {s['p99_ms']} | {s['saturated']['p50_ms']} | {s['samples_per_s']} | "
              f"{c.get('connector')} / {c.get('sidecar')} / {c.get('stream')} = {c.get('total')} | "
              f"{mb(b.get('connector'))} + {mb(b.get('stream'))} = {mb(b.get('total'))} |")  # fmt: skip
    print("\nnotice->tensor, ms: over every sample (all) and over each job's steady-state window (window, "
          f"yields between the {WINDOW[0]:.0%} and {WINDOW[1]:.0%} quantiles of the job's); each job's first {FIRST}")
    print("| arm | job kind | all p50 / p99 / max (n) | window p50 / p99 / max (n) | first 32: p99 per job |")
    print("|---|---|---|---|---|")
    for name, s in arms.items():
        for kind, v in (("paced", s), ("saturated", s["saturated"])):
            if "all" not in v:
                continue
            a, w = v["all"], v["window"]
            print(f"| {name} | {kind} | {a['p50_ms']} / {a['p99_ms']} / {a['max_ms']} ({a['n']}) | "
                  f"{w['p50_ms']} / {w['p99_ms']} / {w['max_ms']} ({w['n']}) | {v[f'first_{FIRST}_p99_ms']} |")
    print("arena / files:", json.dumps(ratios))


# ---------------------------------------------------------------------------------- tiny model
def tiny_section(a: argparse.Namespace) -> dict:
    """The two layouts through real vLLM (CPU) on the tiny verifier, interleaved rounds."""
    import random

    from hsstream.devstack import Stack
    from hsstream.tiny_model import build_tiny_verifier
    from trainer_client import HiddenStateStream

    model = str(build_tiny_verifier())
    stacks = {}
    layouts = [x for x in a.arms if x in ("files", "arena")]  # the stream's default per layout
    for layout in layouts:
        st = Stack(model, TINY_LAYER_IDS, Path(tempfile.mkdtemp(prefix=f"hsstream-arena-tiny-{layout}-")))
        st.env.update(HSSTREAM_SPOOL_LAYOUT=layout, HSSTREAM_MAX_CONCURRENCY=str(a.tiny_concurrency))
        stacks[layout] = st
    rounds: dict[str, list[dict]] = {k: [] for k in layouts}

    def procs(st) -> tuple[int, int]:  # noqa: ANN001
        by = {c.name: c.proc.pid for c in st.children}
        return by["vllm"], by["sidecar"]

    def job(st, n: int, seed: int) -> dict:  # noqa: ANN001
        rng = random.Random(seed)
        ps = [{"token_ids": [rng.randrange(0, 509) for _ in range(a.tiny_prompt_len)]} for _ in range(n)]
        vpid, spid = procs(st)
        cpu0 = {"connector": cpu_s(vpid, tree=True), "sidecar": cpu_s(spid), "stream": cpu_s()}
        t0 = time.perf_counter()
        got: list[tuple[float, float, float]] = []  # (notice sent_at, yielded s after submission, ms)
        hop: dict[str, list[float]] = {}
        t_last, slots = t0, 0
        with st.client() as api:
            jid = api.create_job(ps).job_id
            with HiddenStateStream(st.delivery_endpoint, jobs=[jid], spool_dir=st.spool, credit=a.credit,
                                   pin_memory=False, timeout_s=300) as s:  # fmt: skip
                for x in s:
                    touch(x)
                    slots += x.notice is not None and x.notice.slot is not None
                    t_last = time.perf_counter()
                    if (ms := hops(x, hop)) is not None:
                        got.append((x.notice.sent_at, t_last - t0, ms))
                    del x
                stats = dict(s.stats)
            counts = api.job(jid).counts
        cpu1 = {"connector": cpu_s(vpid, tree=True), "sidecar": cpu_s(spid), "stream": cpu_s()}
        return {"samples": n, "yielded": stats.get("yielded"), "from_slots": slots, "consumed": counts.get("consumed"),
                "failed": counts.get("failed"), "latency_ms": [round(v, 3) for _, _, v in sorted(got)],
                "yield_s": [round(t, 4) for _, t, _ in sorted(got)],
                "hops_ms": {k: [round(v, 3) for v in vs] for k, vs in hop.items()},
                "samples_per_s": round(n / (t_last - t0), 2), "cpu_s": {p: round(cpu1[p] - cpu0[p], 4) for p in cpu0},
                # The connector's counters live inside vLLM's worker: not reachable from here.
                "bytes_copied": {"stream": stats.get("bytes_copied")}}  # fmt: skip

    try:
        for layout, st in stacks.items():
            t = time.perf_counter()
            st.start()
            print(f"tiny {layout} stack up in {time.perf_counter() - t:.0f} s", flush=True)
        for layout, st in stacks.items():  # warm-up: every connection of the concurrency opened
            job(st, max(8, 2 * a.tiny_concurrency), seed=99)
        for r in range(a.tiny_rounds):
            for layout in layouts if r % 2 == 0 else layouts[::-1]:
                res = job(stacks[layout], a.tiny_samples, seed=r)
                rounds[layout].append({"arm": layout, "round": r, "latency_ms": res["latency_ms"], "yield_s": res["yield_s"],
                                       "hops_ms": res["hops_ms"], "saturated": res,
                                       "load_avg_1": round(os.getloadavg()[0], 2)})  # fmt: skip
                print(f"tiny round {r} {layout:6s}: {res['samples_per_s']:7.1f} samples/s, notice->tensor p50 "
                      f"{pctl(res['latency_ms'], 0.5):.2f} ms, consumed {res['consumed']}/{res['samples']}", flush=True)
        left = {k: spool_left(st.spool) for k, st in stacks.items()}
    finally:
        for st in stacks.values():
            st.stop()
            st.remove_spool()
            shutil.rmtree(st.workdir, ignore_errors=True)  # its logs
    arms = {k: summarize_arm(v) for k, v in rounds.items()}
    ratios, checks = compare(arms["files"], arms["arena"]) if len(arms) == 2 else ({}, {})
    checks.pop("fewer_bytes_copied", None)  # the connector's side is not counted here: no verdict on bytes
    print_table("tiny verifier through real vLLM (CPU); latency = saturated job's", arms, ratios)
    return {
        "what": f"tiny verifier (hidden 128, layers {TINY_LAYER_IDS}, bf16) through real vLLM (CPU) and the real "
                f"sidecar, {a.tiny_prompt_len}-token samples, {a.tiny_samples} per job, layouts interleaved",
        "notes": ["p50_ms/p99_ms: notice -> tensor of the saturated jobs (no paced job here)",
                  "cpu connector: vLLM's whole process tree (API server, engine core: the forward included)",
                  "bytes copied: the stream's counter only; the connector's counters are inside vLLM's worker"],
        "rounds": a.tiny_rounds, "samples_per_job": a.tiny_samples, "prompt_len": a.tiny_prompt_len,
        "concurrency": a.tiny_concurrency, "arms": arms, "arena_vs_files": ratios,
        "checks": {**checks, "all_samples_consumed": all(ok_round(x) for v in rounds.values() for x in v)},
        "left_in_spool": left,
        "rounds_detail": [lean(x) for v in rounds.values() for x in v],
    }  # fmt: skip


# ---------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="measured rounds per arm (after a warm-up round each)")
    ap.add_argument("--samples", type=int, default=96, help="samples of each round's saturated job")
    ap.add_argument("--paced-samples", type=int, default=32, help="samples of each round's paced job (0: none)")
    ap.add_argument("--pace-ms", type=float, default=150.0, help="the stand-in starts one sample per this interval "
                    "in the paced job (longer than the pipeline's time per sample: each crosses it idle)")
    ap.add_argument("--concurrency", type=int, default=16, help="the sidecars' HSSTREAM_MAX_CONCURRENCY")
    ap.add_argument("--budget-samples", type=int, default=16, help="spool budget, in samples")
    ap.add_argument("--credit", type=int, default=8, help="the stream's credit (its default)")
    ap.add_argument("--max-p50-ratio", type=float, default=0.6, help="acceptance: arena p50 <= this x files'")
    ap.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True,
                    help="also the tiny verifier through real vLLM (two Stacks)")
    ap.add_argument("--tiny-only", action="store_true", help="(development) the tiny section alone")
    ap.add_argument("--tiny-rounds", type=int, default=5)
    ap.add_argument("--tiny-samples", type=int, default=64)
    ap.add_argument("--tiny-prompt-len", type=int, default=256)
    ap.add_argument("--tiny-concurrency", type=int, default=16)
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="(development) arms to run")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, few samples, tiny left out")
    ap.add_argument("--spool-parent", default="/dev/shm")
    ap.add_argument("--out", default=str(ROOT / "bench/results/arena_cpu.json"))
    ap.add_argument("--stand-in", nargs=3, metavar=("PORT", "SPOOL", "NOTICE_EP"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.stand_in:
        stand_in(int(a.stand_in[0]), a.stand_in[1], a.stand_in[2])
        return 0
    if a.quick:
        a.rounds, a.samples, a.paced_samples, a.tiny = 1, 12, 6, False
    import torch

    doc: dict[str, Any] = {
        "benchmark": "arena", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/arena/arena.py " + " ".join(sys.argv[1:]),
        "host": platform.node(), "cpu_model": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__,
    }  # fmt: skip
    ok = True
    if not a.tiny_only:
        ok = main_section(a, doc)
    if a.tiny or a.tiny_only:
        try:
            doc["tiny"] = tiny_section(a)
            ok = ok and doc["tiny"]["checks"].get("all_samples_consumed", False)
        except Exception as e:  # noqa: BLE001 - the main section's figures are written anyway
            doc["tiny"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print("tiny section failed:", doc["tiny"]["error"], flush=True)
            ok = False
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", a.out)
    return 0 if ok else 1


def main_section(a: argparse.Namespace, doc: dict) -> bool:
    """The Qwen3-8B shape through the stand-in: both stacks, interleaved rounds; fills ``doc``."""
    model_dir = write_model_config(Path(tempfile.mkdtemp(prefix="hsstream-arena-bench-model-")))
    arms = {k: Arm(k, a, model_dir) for k in a.arms}
    rounds: dict[str, list[dict]] = {k: [] for k in arms}
    t_start = time.time()
    try:
        for arm in arms.values():
            arm.start()
        for name, arm in arms.items():  # warm-up: connections, the arena's pages, the stream's threads
            w = arm.run_round(-1, a)
            print(f"warm-up {name}: ok {ok_round(w)}", flush=True)
        for r in range(a.rounds):
            for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                res = arms[name].run_round(r, a)
                rounds[name].append(res)
                s = res["saturated"]
                print(f"round {r} {name:6s}: notice->tensor p50 {pctl(res['latency_ms'], 0.5):7.2f} ms (saturated "
                      f"{pctl(s['latency_ms'], 0.5):7.2f}), {s['samples_per_s']:6.1f} samples/s, CPU s {s['cpu_s']}, "
                      f"copied {s['bytes_copied']}, consumed {s['consumed']}/{s['samples']}, "
                      f"load {res['load_avg_1']}", flush=True)  # fmt: skip
        left = {k: spool_left(arm.spool) for k, arm in arms.items()}
    finally:
        for arm in arms.values():
            arm.stop()
        shutil.rmtree(model_dir, ignore_errors=True)
    summ = {k: summarize_arm(v) for k, v in rounds.items()}
    doc.update({
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "what": "notice -> tensor, CPU per sample, bytes copied per sample and samples/s of the two spool layouts "
                "(the arena also with verify_slots: arena_verified), "
                "1,024-token samples of the Qwen3-8B shape through the connector's real code (stand-in vLLM), the "
                "real sidecar and a HiddenStateStream, arms interleaved",
        "rounds": a.rounds,
        "shape": {"model": "Qwen3-8B", "tokens": TOKENS, "layer_ids": LAYER_IDS, "hidden_size": QWEN3_8B["hidden_size"],
                  "dtype": "bfloat16", "hidden_state_bytes": TOKENS * len(LAYER_IDS) * QWEN3_8B["hidden_size"] * 2,
                  "block_size": BLOCK_SIZE,
                  "cache_layout": "[blocks, K, block_size, H] view of [blocks, block_size, K, H]"},
        "config": {"samples_per_job": a.samples, "paced_samples": a.paced_samples, "pace_ms": a.pace_ms,
                   "concurrency": a.concurrency, "budget_samples": a.budget_samples, "credit": a.credit,
                   "trainer": "HiddenStateStream in the bench's own process (pin_memory off, default workers)"},
        "notes": ["p50_ms/p99_ms: notice (connector's sent_at) -> the sample yielded to the loop, in the paced jobs "
                  "(each sample through an idle pipeline), pooled over rounds; saturated: the same in the "
                  "saturated jobs",
                  "cpu_ms_per_sample: psutil user+system over each saturated job / its samples, median over rounds; "
                  "connector = the stand-in process (gather, checksum, write, notice, and its HTTP serving)",
                  "bytes_copied_per_sample: deltas of SpoolWriter.stats['bytes_copied'] (connector) and "
                  "HiddenStateStream.stats['bytes_copied'] (stream) over each saturated job / its samples",
                  "samples_per_s: samples / (last yield - job submitted), saturated job, median over rounds"],
        "arms": summ,
    })  # fmt: skip
    ok = all(ok_round(x) for v in rounds.values() for x in v) and not any(left.values())
    if "files" in summ and "arena_verified" in summ:
        doc["arena_verified_vs_files"], _ = compare(summ["files"], summ["arena_verified"], a.max_p50_ratio)
        print("arena_verified / files:", json.dumps(doc["arena_verified_vs_files"]))
    if "files" in summ and "arena" in summ:
        doc["arena_vs_files"], checks = compare(summ["files"], summ["arena"], a.max_p50_ratio)
        doc["checks"] = {**checks, "all_samples_consumed": ok}
        print_table(f"Qwen3-8B shape, {TOKENS} tokens, {a.rounds} rounds", summ, doc["arena_vs_files"])
        print("checks:", doc["checks"])
    doc["left_in_spool"] = left
    doc["rounds_detail"] = [lean(x) for v in rounds.values() for x in v]
    return ok


if __name__ == "__main__":
    sys.exit(main())
