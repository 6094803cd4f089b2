#!/usr/bin/env python3
"""Online training on GPUs, end to end, beside plain vLLM: the benchmark users look at.

vLLM on ``--vllm-gpus`` feeds hidden states (Qwen3-8B shape, layers [2, 18, 33, 36],
1,024-token samples submitted over REST as token ids) to consumers on ``--trainer-gpus``.
One call runs, in this order (``--rounds`` repeats the sequence: a b c a b c ...):

(a) ``plain``: plain vLLM (no extraction), its OpenAI server, the same prompts sent by a
    client with the same concurrency as the sidecar's (one ``/v1/completions`` call per
    prompt, ``max_tokens=1``): prefill tok/s. Same server path as (b), so the two compare.
(b) ``stream``: vLLM + our connector -> /dev/shm spool -> sidecar -> ``HiddenStateStream`` ->
    tensors resident in the trainer GPU's memory (pinned host buffer, async copy, event), no
    training: tokens/s delivered onto the trainer GPU ÷ (a); latency from the connector's
    notice (``Notice.sent_at``) to the sample on the trainer GPU, p50/p99, one host clock;
    the floor (read one sample's file from tmpfs and copy it to the GPU); where time goes.
(c) ``train``: the same stack with Eagle-3 training on the trainer GPU (draft vocabulary
    32k): trainer samples/s and tokens/s, its share of time waiting for data, vLLM's tok/s
    meanwhile, peak spool bytes vs budget, and which side bounds throughput.

Rates are taken in steady state: from the 10th to the 90th percentile of completion times
(responses for (a), samples on the trainer GPU for (b), samples handed to the trainer for (c)).
KV-cache capacity with and without extraction comes from vLLM's "KV cache size" log line.

One process orchestrates; vLLM, the sidecar and the consumers are child processes in their
own process groups, each configuration is bounded in time, everything (engines, spool) is
stopped and removed even on failure, and the JSON is rewritten after every configuration.

GPU (H200 x2):  python bench/online_gpu.py --vllm-gpus 0 --trainer-gpus 1
CPU smoke:      python bench/online_gpu.py --smoke
Command lines for other splits:  python bench/online_gpu.py --vllm-gpus 0,1 --vllm-tp 2 --dry-run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import checkpoints as C  # noqa: E402

LAYERS = [2, 18, 33, 36]
CONFIGS = ("plain", "stream", "stream_ordered", "train")
WINDOW = (0.10, 0.90)
_KV_RE = re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens")


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


class ConfigFailed(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------


def window_rate(times: list[float], tokens_each: int, lo: float = WINDOW[0], hi: float = WINDOW[1]) -> dict:
    """Tokens/s between the ``lo`` and ``hi`` quantiles of completion times (steady state)."""
    t = sorted(times)
    n = len(t)
    if n < 4:
        return {"tok_per_s": None, "samples": n, "why": "fewer than 4 completions"}
    i, j = int(math.floor(lo * (n - 1))), int(math.ceil(hi * (n - 1)))
    dt = t[j] - t[i]
    if dt <= 0:
        return {"tok_per_s": None, "samples": n, "why": "no time between the window's ends"}
    return {"tok_per_s": round((j - i) * tokens_each / dt, 1), "samples_per_s": round((j - i) / dt, 2),
            "window": [lo, hi], "window_samples": j - i, "window_s": round(dt, 3), "samples": n,
            "overall_tok_per_s": round(n * tokens_each / (t[-1] - t[0]), 1) if t[-1] > t[0] else None}  # fmt: skip


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def kv_tokens(log_path: Path) -> list[int]:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [int(m.replace(",", "")) for m in _KV_RE.findall(text)]


class SpoolWatch:
    """Peak bytes on the spool (files and temp files), polled; the budget is the sidecar's."""

    def __init__(self, spool: Path, every_s: float = 0.02) -> None:
        self.spool, self.every_s = spool, every_s
        self.peak = self.peak_files = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = n = 0
            try:
                with os.scandir(self.spool) as it:
                    for e in it:
                        try:
                            total += e.stat(follow_symlinks=False).st_size
                            n += 1
                        except OSError:
                            pass
            except OSError:
                pass
            self.peak, self.peak_files = max(self.peak, total), max(self.peak_files, n)
            self._stop.wait(self.every_s)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join(2)
        return {"peak_bytes": self.peak, "peak_files": self.peak_files}


# ----------------------------------------------------------------------------------------------
# Consumer child (runs on a trainer GPU): (b) deliver to the GPU, (c) train
# ----------------------------------------------------------------------------------------------


def _device(spec: dict):  # noqa: ANN202
    import torch

    if spec["device"] == "cuda" and torch.cuda.is_available():
        dev = torch.device("cuda", 0)  # the first of this process's CUDA_VISIBLE_DEVICES
        torch.empty(1, device=dev)
        return dev
    return torch.device("cpu")


def measure_floor(spec: dict, dev) -> dict:  # noqa: ANN001
    """Reading one sample's file from tmpfs and copying it to the GPU, alone: the floor no
    pipeline beats (``total_parallel_read``: the file's parts read at once into a reused pinned
    buffer, as the stream reads, then one DMA; ``total``: safetensors' read, a copy into pinned
    memory, the DMA). Also each check the stream makes on the same sample, both checksum kinds
    on all threads, the read on one thread (``read_into_pinned_one_thread``), the stream's whole
    per-sample path (``stream_check_path``: read, checks, copy and finiteness on the GPU), and
    a pinned buffer torch's cache cannot hand back (``alloc_pinned_new``: what a cold burst pays)."""
    import collections

    import numpy as np
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from connector import protocol as P
    from trainer_client import sample_reader as R
    from trainer_client import stream as S

    T, K, H = spec["prompt_len"], len(spec["layers"]), spec["hidden_size"]
    g = torch.Generator().manual_seed(0)
    hs = (torch.randn((T, K, H), generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (T,), dtype=torch.int64, generator=g)
    d = Path(tempfile.mkdtemp(prefix="hsstream-floor-", dir="/dev/shm"))
    path = d / "floor.safetensors"
    try:
        save_file({P.HIDDEN_STATES_KEY: hs, P.TOKEN_IDS_KEY: ids}, str(path))
        cuda = dev.type == "cuda"
        pinned = torch.empty((T, K, H), dtype=torch.bfloat16, pin_memory=cuda)
        rows: dict[str, list[float]] = collections.defaultdict(list)
        notice = P.Notice(status=P.NoticeStatus.ok, request_id="floor", key=P.SampleKey(job="floor", index=0),
                          file=path.name, num_tokens=T, layer_ids=spec["layers"], hidden_size=H, dtype="bfloat16",
                          checksum=P.checksum(hs.view(torch.uint8).numpy(), ids.numpy()))  # fmt: skip
        deliver = P.Deliver(notice=notice, expected_token_ids=ids.tolist())
        pbuf = torch.empty(path.stat().st_size, dtype=torch.uint8, pin_memory=cuda)
        for _ in range(spec.get("floor_reps", 20)):
            t0 = time.perf_counter()
            with safe_open(str(path), framework="pt") as f:
                x = f.get_tensor(P.HIDDEN_STATES_KEY)
            t1 = time.perf_counter()
            pinned.copy_(x)
            y = pinned.to(dev, non_blocking=True)
            if cuda:
                torch.cuda.current_stream(dev).synchronize()
            t2 = time.perf_counter()
            rows["read"].append(t1 - t0)
            rows["h2d"].append(t2 - t1)
            rows["total"].append(t2 - t0)
            t3 = time.perf_counter()
            P.checksum(x.view(torch.uint8).numpy(), ids.numpy())
            t4 = time.perf_counter()
            bool(torch.isfinite(x).all())
            t5 = time.perf_counter()
            bool(torch.isfinite(y).all())
            t6 = time.perf_counter()
            ids.tolist()
            t7 = time.perf_counter()
            rows["checksum"].append(t4 - t3)
            rows["finite_cpu"].append(t5 - t4)
            rows["finite_device"].append(t6 - t5)
            rows["ids_tolist"].append(t7 - t6)
            fd = os.open(path, os.O_RDONLY)
            t9 = time.perf_counter()
            os.readv(fd, [memoryview(pbuf.numpy())])
            rows["read_into_pinned_one_thread"].append(time.perf_counter() - t9)
            os.close(fd)
            t9 = time.perf_counter()
            for k in (2, 4, 8):  # parts read at once by k threads (the stream's default: R.READ_THREADS)
                fd = os.open(path, os.O_RDONLY)
                t9 = time.perf_counter()
                S.read_parallel(fd, memoryview(pbuf.numpy()), path.stat().st_size, threads=k)
                rows[f"read_into_pinned_{k}_threads"].append(time.perf_counter() - t9)
                os.close(fd)
            t9 = time.perf_counter()
            got = S.read_into_buffer(path, None, lambda n: pbuf[:n], tm := {})
            rows["read_into_pinned"].append(tm["read_s"])  # parts read at once (R.READ_THREADS)
            if cuda:
                got[P.HIDDEN_STATES_KEY].to(dev, non_blocking=True)
                torch.cuda.current_stream(dev).synchronize()
            rows["total_parallel_read"].append(time.perf_counter() - t9)  # the floor with parts read at once
            for algo in P.CHECKSUM_ALGOS:
                t9 = time.perf_counter()
                P.checksum(x.view(torch.uint8).numpy(), ids.numpy(), algo=algo, threads=0)
                rows[f"checksum_{algo}_all_threads"].append(time.perf_counter() - t9)
            if cuda:  # the stream's whole per-sample path, one sample alone: read, checks, on the GPU
                t9 = time.perf_counter()
                S.load_and_check(d, deliver, pin_memory=True, device=dev, alloc=lambda n: pbuf[:n])
                rows["stream_check_path"].append(time.perf_counter() - t9)
            t8 = time.perf_counter()
            S.all_finite(x)
            rows["finite_cpu_bits"].append(time.perf_counter() - t8)
        extra: dict = {}
        if cuda:  # a third way: DMA straight from the file's tmpfs pages (mapped, page-locked in place)
            try:
                for _ in range(spec.get("floor_reps", 20)):
                    for k, v in _registered_copy(path, dev).items():
                        rows[f"registered_{k}"].append(v)
                extra["registered_bytes_equal"] = bool(torch.equal(
                    _registered_copy(path, dev, keep=True).cpu(), torch.from_numpy(np.fromfile(path, dtype=np.uint8))))
            except Exception as e:  # noqa: BLE001 - a host or driver that refuses: say so, go on
                extra["registered_error"] = repr(e)[:300]
        held = []
        rows["alloc_pinned_new"] = []
        for _ in range(4 if cuda else 0):  # each kept alive, so the cache cannot reuse one
            t0 = time.perf_counter()
            held.append(torch.empty(path.stat().st_size, dtype=torch.uint8, pin_memory=True))
            rows["alloc_pinned_new"].append(time.perf_counter() - t0)
        del held
        rows = {k: v for k, v in rows.items() if v}
        return {"bytes": path.stat().st_size, "device": str(dev), "read_threads": R.READ_THREADS, **extra,
                **{f"{k}_ms_p50": round(1000 * statistics.median(v), 3) for k, v in rows.items()}}  # fmt: skip
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _registered_copy(path: Path, dev, keep: bool = False):  # noqa: ANN001, ANN202
    """One file onto the GPU with no host copy: mmap it, page-lock the mapping in place
    (``cudaHostRegister``, read-only), one DMA, unregister. Seconds per phase (or the device
    tensor with ``keep``)."""
    import mmap
    import warnings

    import numpy as np
    import torch

    cudart = torch.cuda.cudart()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        arr = np.frombuffer(mm, dtype=np.uint8)
        ptr = arr.ctypes.data
        t1 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, size, 8)  # cudaHostRegisterReadOnly
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: error {int(err)}")
        t2 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only numpy array
            src = torch.from_numpy(arr)
        out = torch.empty(size, dtype=torch.uint8, device=dev)
        out.copy_(src, non_blocking=True)
        torch.cuda.current_stream(dev).synchronize()
        t3 = time.perf_counter()
        cudart.cudaHostUnregister(ptr)
        t4 = time.perf_counter()
        del src, arr
        mm.close()
    finally:
        os.close(fd)
    if keep:
        return out
    return {"map": t1 - t0, "register": t2 - t1, "h2d": t3 - t2, "unregister": t4 - t3, "total": t4 - t0}


def _wait_for_job(spec: dict) -> str:
    Path(spec["ready_file"]).write_text(str(os.getpid()))
    deadline = time.monotonic() + spec.get("job_wait_s", 120)
    jf = Path(spec["job_file"])
    while not jf.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no job to consume was announced")
        time.sleep(0.01)
    return json.loads(jf.read_text())["job"]


def consume_deliver(spec: dict) -> dict:
    """(b): every sample's hidden states into this GPU's memory; the last few stay resident."""
    import collections

    import torch

    from connector import protocol as P

    from trainer_client import HiddenStateStream

    dev = _device(spec)
    res: dict = {"device": str(dev)}
    if spec.get("floor"):
        res["floor"] = measure_floor(spec, dev)
    cuda = dev.type == "cuda"
    resident: collections.deque = collections.deque(maxlen=spec.get("resident", 32))
    n = 0
    # pin_memory: the stream reads each file once, straight into page-locked memory, so the
    # copy to the GPU is one non-blocking DMA (no staging copy here). With finite_on_device the
    # stream's workers make that copy and check finiteness on the GPU; the .to() below is a no-op.
    on_dev = cuda and spec.get("finite_on_device", False)
    # Connected, warm and waiting before the job exists, as a trainer is when a job is submitted
    # to it (``jobs=None, follow=True``: the bench runs one job at a time; idle yields say when
    # the HELLO is out). Pinned buffers are warmed for this sample size first: otherwise the
    # first delivery pays for them while vLLM's first batch piles up.
    res["stream_opened_at"] = time.time()
    T, K, H = spec["prompt_len"], len(spec["layers"]), spec["hidden_size"]
    sample_bytes = T * K * H * 2 + 8 * T + P.HEADER_ALLOWANCE
    with open(spec["records"], "w", buffering=1) as rec, \
            HiddenStateStream(spec["endpoint"], jobs=None, follow=True, spool_dir=spec["spool"], credit=spec["credit"],
                              timeout_s=max(60.0, spec.get("job_wait_s") or 0), pin_memory=cuda,
                              workers=spec.get("stream_workers"), device=dev if on_dev else None,
                              ordered=spec.get("ordered"), idle_s=0.1) as stream:  # fmt: skip
        if cuda:
            stream.host_buffers.warm(sample_bytes, spec["credit"] + 1)
        t_end = None
        for s in stream:
            if s is None:  # idle: connected and nothing delivered yet
                if t_end is None:
                    Path(spec["ready_file"]).write_text(str(os.getpid()))
                    t_end = time.monotonic() + spec.get("job_wait_s", 120) + spec["time_limit_s"]
                if time.monotonic() > t_end:
                    res["stopped"] = "time limit"
                    break
                continue
            if n == 0:
                t_end = time.monotonic() + spec["time_limit_s"]
            t_y = time.time()
            hs = s.hidden_states
            if cuda:
                g = hs.to(dev, non_blocking=True)
                torch.cuda.current_stream(dev).synchronize()  # on the GPU: now it counts
            else:
                g = hs.clone()
            t_g = time.time()
            resident.append(g)
            nt = s.notice
            rec.write(json.dumps({"n": int(s.token_ids.shape[0]), "sent": nt.sent_at if nt else None, "y": t_y,
                                  "g": t_g, "stream": s.timings, "conn": nt.timings if nt else {}}) + "\n")  # fmt: skip
            n += 1
            if n >= spec["n_samples"] or time.monotonic() > t_end:
                res["stopped"] = "time limit" if n < spec["n_samples"] else "all samples"
                break
    res["samples"] = n
    res["stream_stats"] = dict(stream.stats)
    res["stream_pool"] = {"workers": stream.workers, "max_held": stream._pool.max_held,
                          "max_running": stream._pool.max_running, "finite_on_device": bool(on_dev),
                          "host_buffers": dict(stream.host_buffers.stats)}  # fmt: skip
    return res


def train_config(spec: dict):  # noqa: ANN201
    """The trainer's configuration for the benchmark: the one place that knows TrainConfig's
    fields (the trainer API is being extended with ``device``/precision; set what exists)."""
    from trainer_client.train.trainer import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    kw = dict(verifier=spec["model"], out_dir=spec["train_out"], draft_vocab_size=spec["draft_vocab"],
              max_steps=spec["n_samples"], checkpoint_every=10**9, keep_checkpoints=1, tensorboard=False,
              progress=False, log_every=50, samples_per_step=1, max_tokens_per_step=max(4096, spec["prompt_len"]),
              extra={"benchmark": "online_gpu"}, draft=spec.get("draft", "eagle3"),
              mask_token_id=spec.get("mask_token_id"), block_size=spec.get("block_size", 4))  # fmt: skip
    if "device" in names:
        kw["device"] = spec["device_str"]
    return TrainConfig(**{k: v for k, v in kw.items() if k in names}), sorted(set(kw) - names)


class _TimedStream:
    """The stream as the trainer sees it, recording when each sample is handed over and ending
    the stream at the time limit (the trainer then checkpoints and acks as at a job's end)."""

    def __init__(self, stream, spec: dict, rec) -> None:  # noqa: ANN001
        self._s, self._spec, self._rec = stream, spec, rec
        self.n = 0
        self.stopped = None

    def __iter__(self):  # noqa: ANN204
        t_end = time.monotonic() + self._spec["time_limit_s"]
        for s in self._s:
            if s is None:  # the stream's idle yield: the trainer checkpoints or waits, then asks again
                yield None
                if time.monotonic() > t_end:
                    self.stopped = "time limit"
                    return
                continue
            nt = s.notice
            self._rec.write(json.dumps({"n": int(s.token_ids.shape[0]), "sent": nt.sent_at if nt else None,
                                        "y": time.time(), "stream": s.timings, "rank": int(os.environ.get("RANK", "0")),
                                        "conn": nt.timings if nt else {}}) + "\n")  # fmt: skip
            self.n += 1
            yield s
            if time.monotonic() > t_end:
                self.stopped = "time limit"
                return

    def __getattr__(self, name: str):  # noqa: ANN204 - ack_through, keepalive, ... go to the stream
        return getattr(self._s, name)


def consume_train(spec: dict) -> dict:
    """(c): training the ``--draft`` (Eagle-3, P-EAGLE, DFlash) on this GPU, fed by the stream."""
    from trainer_client import HiddenStateStream
    from trainer_client.train import vocab as V
    from trainer_client.train.run import drained_probe
    from trainer_client.train.trainer import OnlineTrainer

    from trainer_client.train.config import resolve_device
    from trainer_client.train.distributed import World

    world = None
    if World.env_size() > 1:  # a rank under torchrun (--trainer-nproc): cuda:LOCAL_RANK, gloo on CPU
        n = World.env_size()
        dev = resolve_device(spec["device"], local_rank=World.env_local_rank(), world_size=n)
        world = World.from_env(dev)
        spec = {**spec, "n_samples": max(1, spec["n_samples"] // n)}  # steps: every rank trains one sample each
    else:
        dev = _device(spec)
    spec = {**spec, "device_str": str(dev)}
    cfg, unsupported = train_config(spec)
    counts = V.token_counts_from_file(spec["token_counts"])
    t0 = time.perf_counter()
    probe: list = []  # the job is announced only once the trainer is ready
    writer = world is None or world.is_writer

    def drained(pending: int) -> bool:
        return bool(probe) and probe[0](pending)

    trainer = OnlineTrainer(cfg, counts, drained=drained if writer else None, world=world)
    trainer.prepare()  # speculators' import, verifier heads: before the stream (leases would lapse)
    res: dict = {"prepare_s": round(time.perf_counter() - t0, 1), "config_fields_not_supported": unsupported}
    job = _wait_for_job(spec)
    if writer:  # as hsstream train: rank 0 asks the sidecar, the ranks agree through their collectives
        probe.append(drained_probe(spec["api"], [job]))
    with open(spec["records"], "w", buffering=1) as rec, \
            HiddenStateStream(spec["endpoint"], jobs=[job], spool_dir=spec["spool"], credit=spec["credit"],
                              ack="manual", timeout_s=60, workers=spec.get("stream_workers"),
                              ordered=spec.get("ordered"), **trainer.stream_options()) as stream:  # fmt: skip
        ts = _TimedStream(stream, spec, rec)
        r = trainer.train(ts)
    p = next(iter(trainer.model.parameters()))
    if p.device.type == "cuda":
        import torch

        res["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(p.device) / 2**30, 2)
        res["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(p.device) / 2**30, 2)
    res.update(draft=cfg.draft, device_requested=str(dev), device_used=str(p.device), dtype=str(p.dtype), autocast=r.autocast,
               stream_options={k: v for k, v in trainer.stream_options().items()}, data_stats=trainer.data_stats,
               samples=r.samples,
               tokens=r.tokens, steps=r.steps, wall_s=r.wall_s, wait_s=r.wait_s,
               wait_frac=round(r.wait_s / r.wall_s, 4) if r.wall_s else None, loss=r.loss,
               stopped=ts.stopped or "all samples")  # fmt: skip
    return res


def consumer_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("ranks", 1) > 1:  # under torchrun: this rank's own files, named by the orchestrator
        sfx = f"-r{int(os.environ.get('RANK', '0'))}"
        work, tag = Path(spec["work"]), spec["tag"]
        spec.update(ready_file=str(work / f"{tag}{sfx}.ready"), job_file=str(work / f"{tag}{sfx}.job.json"),
                    records=str(work / f"{tag}{sfx}.records.jsonl"))  # fmt: skip
        out_path = str(work / f"{tag}{sfx}.result.json")
    try:
        res = consume_train(spec) if spec["mode"] == "train" else consume_deliver(spec)
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        res = {"ok": False, "error": repr(e)[:1000]}
    Path(out_path).write_text(json.dumps(res, default=str))
    sys.stdout.flush()
    os._exit(0 if res["ok"] else 1)


# ----------------------------------------------------------------------------------------------
# Orchestrator
# ----------------------------------------------------------------------------------------------


def vllm_flags(args: argparse.Namespace) -> list[str]:
    """vLLM flags shared by (a) and (b)/(c), so the two differ only by the extraction."""
    from hsstream import launch

    f = ["--load-format", "dummy", "--skip-tokenizer-init", "--seed", "0", "--max-num-seqs", str(args.max_num_seqs),
         "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    return f + launch.parallel_args(len(args.vllm_gpu_list), args.vllm_tp)


def plain_options(args: argparse.Namespace, model: str, port: int):  # noqa: ANN201
    from hsstream import launch

    return launch.VllmOptions(model=model, layer_ids=LAYERS if not args.smoke else args.layers, spool_dir="",
                              notice_endpoint="", port=port, max_model_len=args.max_model_len,
                              gpu_memory_utilization=args.gpu_mem_util, enforce_eager=True,
                              served_model_name="verifier", extraction=False, extra=vllm_flags(args))  # fmt: skip


class Orchestrator:
    def __init__(self, args: argparse.Namespace) -> None:
        from hsstream import launch

        self.args = args
        self.cpu = launch.is_cpu_build()
        self.work = Path(tempfile.mkdtemp(prefix="hsstream-online-"))
        self.children: list = []  # launch.Child of whatever runs now
        self.stack = None
        self.doc: dict = {}
        self.prompts: list[list[int]] = []

    # -- children ---------------------------------------------------------------------------------
    def env(self, gpus: str | None) -> dict[str, str]:
        from hsstream import launch

        env = launch.child_env({"PYTHONUNBUFFERED": "1"})
        if gpus is not None and not self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        return env

    def spawn_consumer(self, mode: str, spec: dict, gpu: str | None, tag: str, ranks: int = 1):  # noqa: ANN201
        """One consumer process; ``ranks`` > 1: torchrun with that many trainer ranks (as
        ``hsstream train --nproc``), one per GPU of ``gpu`` (a list), each with its own files."""
        from hsstream import launch

        sp, out = self.work / f"{tag}.spec.json", self.work / f"{tag}.result.json"
        # A tag's files from an earlier run of the same configuration (the stack warm-up uses the
        # measured run's tags) must not tell the orchestrator this consumer is ready, or hand it an
        # old job: the job was then submitted while the consumer was still starting (its CUDA
        # start and floor measurement, seconds of vLLM's output piling up as a start-up backlog).
        for old in self.work.glob(f"{tag}*"):
            if old.suffix in (".ready", ".json", ".jsonl") and old.name != sp.name:
                old.unlink(missing_ok=True)
        sp.write_text(json.dumps({**spec, "ranks": ranks, "work": str(self.work), "tag": tag}))
        env = self.env(gpu)
        if self.cpu:
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // (2 * ranks))))
        run = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc-per-node={ranks}"]  # fmt: skip
        c = launch.spawn(tag, [*run, __file__, "--consumer", str(sp), str(out)], env,
                         log_path=self.work / f"{tag}.log", cwd=str(ROOT))  # fmt: skip
        self.children.append(c)
        return c, out

    def stop_children(self) -> None:
        for c in self.children:
            c.stop(20)
        self.children = []

    # -- configurations -----------------------------------------------------------------------
    def run_plain(self, rnd: int) -> dict:
        from hsstream import launch
        from hsstream.demo import free_port

        a = self.args
        port = free_port()
        cmd = launch.vllm_args(plain_options(a, self.model, port))
        logf = self.work / f"plain-{rnd}.vllm.log"
        t0 = time.perf_counter()
        v = launch.spawn("vllm-plain", cmd, self.env(a.vllm_gpus), log_path=logf, cwd=str(ROOT))
        self.children.append(v)
        try:
            launch.wait_http(f"http://127.0.0.1:{port}/health", v, a.start_timeout)
            start_s = time.perf_counter() - t0
            log(f"(a) plain vLLM up in {start_s:.0f} s; warm-up, then {len(self.prompts)} prompts, "
                f"concurrency {a.concurrency}")  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            asyncio.run(self._client(url, self.warm_prompts, a.concurrency, a.config_timeout))
            times = asyncio.run(self._client(url, self.prompts, a.concurrency, a.config_timeout))
        finally:
            self.stop_children()
        r = window_rate(times, a.prompt_len)
        out = {"config": "plain", "round": rnd, "engine_start_s": round(start_s, 1), "kv_cache_tokens": kv_tokens(logf),
               "rate": r, "path": "vLLM OpenAI server /v1/completions, one prompt per call (token ids, "
               "max_tokens=1), same concurrency as the sidecar's"}  # fmt: skip
        log(f"(a) plain: {r.get('tok_per_s')} tok/s (steady state), KV cache {out['kv_cache_tokens']} tokens")
        return out

    async def _client(self, url: str, ps: list[list[int]], conc: int, timeout: float) -> list[float]:
        import httpx

        sem = asyncio.Semaphore(conc)
        done: list[float] = []
        limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as c:

            async def one(p: list[int]) -> None:
                async with sem:
                    r = await c.post(f"{url}/v1/completions", json={"model": "verifier", "prompt": p, "max_tokens": 1,
                                                                    "temperature": 0.0})  # fmt: skip
                    if r.status_code != 200:
                        raise ConfigFailed(f"plain vLLM answered {r.status_code}: {r.text[:300]}")
                    done.append(time.time())

            await asyncio.wait_for(asyncio.gather(*(one(p) for p in ps)), timeout)
        return done

    def start_stack(self, rnd: int) -> float:
        from hsstream.demo import Stack

        a = self.args
        t0 = time.perf_counter()
        st = Stack(self.model, a.layers, self.work / f"stack-{rnd}", max_model_len=a.max_model_len,
                   gpu_memory_utilization=a.gpu_mem_util, vllm_extra=vllm_flags(a), vllm_gpus=a.vllm_gpus)  # fmt: skip
        (self.work / f"stack-{rnd}").mkdir(exist_ok=True)
        st.env.update({
            "HSSTREAM_MAX_CONCURRENCY": str(a.concurrency),
            "HSSTREAM_SPOOL_BUDGET_BYTES": str(int(a.spool_budget_gib * 2**30)),
            "HSSTREAM_NUM_WRITER_THREADS": str(a.writer_threads),
            "HSSTREAM_CHECKSUM": a.checksum,
        })  # fmt: skip
        self.stack = st
        st.start()
        log(f"stack (vLLM + connector + sidecar) up in {time.perf_counter() - t0:.0f} s, spool {st.spool}")
        return time.perf_counter() - t0

    def stop_stack(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack.remove_spool()
            self.stack = None

    def submit(self, ps: list[list[int]]) -> str:
        from connector.contract.rest_client import SidecarClient, SidecarError

        try:
            with SidecarClient(self.stack.api, timeout=120) as c:
                return c.create_job([{"token_ids": p} for p in ps]).job_id
        except SidecarError as e:
            raise ConfigFailed(f"the sidecar refused the job: {str(e)[:300]}") from e

    def cancel(self, job: str) -> None:
        from connector.contract.rest_client import SidecarClient, SidecarError

        try:
            with SidecarClient(self.stack.api, timeout=30) as c:
                c.cancel(job)
        except SidecarError:
            pass

    def consumer_spec(self, mode: str, tag: str, n: int, ordered: bool | None = None) -> dict:
        a, st = self.args, self.stack
        return {"mode": mode, "endpoint": st.delivery_endpoint, "spool": str(st.spool), "api": st.api,
                "device": "cpu" if self.cpu else "cuda", "layers": a.layers, "prompt_len": a.prompt_len,
                "hidden_size": self.shape["hidden_size"], "n_samples": n, "time_limit_s": a.consumer_seconds,
                "credit": a.credit, "records": str(self.work / f"{tag}.records.jsonl"),
                "stream_workers": a.stream_workers, "finite_on_device": a.finite_on_device,
                "ordered": a.ordered if ordered is None else ordered,
                "ready_file": str(self.work / f"{tag}.ready"), "job_file": str(self.work / f"{tag}.job.json"),
                "job_wait_s": a.start_timeout, "floor": mode == "deliver", "model": self.model,
                "train_out": str(self.work / f"{tag}.train"), "draft_vocab": a.draft_vocab,
                "draft": a.draft, "mask_token_id": a.mask_token_id, "block_size": a.block_size,
                "token_counts": str(self.work / "token_counts.json")}  # fmt: skip

    def run_consumers(self, mode: str, rnd: int, ps: list[list[int]], ordered: bool | None = None) -> dict:
        """Start the consumers, wait until they are ready, submit the job, follow it to the end."""
        a = self.args
        gpus = a.trainer_gpu_list if mode == "deliver" else a.trainer_gpu_list[:1]
        procs = []
        if mode == "train" and a.trainer_nproc > 1:  # one torchrun, its ranks followed as consumers
            tag = f"{mode}-{rnd}-0"
            spec = self.consumer_spec(mode, tag, len(ps))
            c, _ = self.spawn_consumer(mode, spec, ",".join(a.trainer_gpu_list[: a.trainer_nproc]), tag,
                                       ranks=a.trainer_nproc)  # fmt: skip
            procs = [(f"{tag}-r{k}", c, self.work / f"{tag}-r{k}.result.json") for k in range(a.trainer_nproc)]
            gpus = []
        for i, g in enumerate(gpus):
            tag = f"{mode}-{rnd}-{i}"
            spec = self.consumer_spec(mode, tag, len(ps) if mode == "train" else math.ceil(len(ps) / len(gpus)),
                                      ordered)  # fmt: skip
            procs.append((tag, *self.spawn_consumer(mode, spec, g, tag)))
        deadline = time.monotonic() + a.start_timeout
        for tag, c, _ in procs:
            while not (self.work / f"{tag}.ready").exists():
                if not c.alive():
                    raise ConfigFailed(f"consumer {tag} exited while starting:\n{c.tail()}")
                if time.monotonic() > deadline:
                    raise ConfigFailed(f"consumer {tag} not ready after {a.start_timeout:.0f} s:\n{c.tail()}")
                time.sleep(0.05)
        submitted_at = time.time()
        job = self.submit(ps)
        watch = SpoolWatch(self.stack.spool)
        t0 = time.time()
        for tag, _, _ in procs:
            (self.work / f"{tag}.job.json").write_text(json.dumps({"job": job}))
        limit = a.consumer_seconds + a.config_grace
        results = []
        try:
            for tag, c, out in procs:
                left = max(1.0, limit - (time.time() - t0))
                try:
                    c.proc.wait(left)
                except subprocess.TimeoutExpired:
                    raise ConfigFailed(f"consumer {tag} did not finish within {limit:.0f} s:\n{c.tail()}") from None
                if not out.exists():
                    raise ConfigFailed(f"consumer {tag} exited ({c.proc.returncode}) without a result:\n{c.tail()}")
                r = json.loads(out.read_text())
                if not r.get("ok"):
                    raise ConfigFailed(f"consumer {tag} failed: {r.get('error')}\n{c.tail()}")
                results.append((tag, r))
        finally:
            spool = watch.stop()
            self.cancel(job)
            self.stop_children()
        recs = []
        for tag, _ in results:
            p = self.work / f"{tag}.records.jsonl"
            recs += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        return {"job": job, "results": [r for _, r in results], "records": recs, "submitted_at": submitted_at,
                "accepted_at": t0,
                "spool": {**spool, "budget_bytes": int(a.spool_budget_gib * 2**30)}}  # fmt: skip

    def run_stream(self, rnd: int, plain_rate: float | None, *, ordered: bool | None = None) -> dict:
        """(b); ``ordered``: the stream yields in delivery order (the ``stream_ordered`` config,
        run beside ``stream`` on the same stack to show what that order costs)."""
        a = self.args
        r = self.run_consumers("deliver", rnd, self.prompts, ordered)
        recs = r["records"]
        deliver = window_rate([x["g"] for x in recs], a.prompt_len)
        vllm = window_rate([x["sent"] for x in recs if x.get("sent")], a.prompt_len)
        lat_all = [1000 * (x["g"] - x["sent"]) for x in recs if x.get("sent")]
        # Latency in the same steady-state window as the rates: the first samples' notices can
        # precede the consumer's connection (it connects once the job exists), the tail is
        # drained after the last request; both are reported apart, in "all".
        gs = sorted(x["g"] for x in recs)
        lo_t = gs[int(math.floor(WINDOW[0] * (len(gs) - 1)))] if gs else 0.0
        hi_t = gs[int(math.ceil(WINDOW[1] * (len(gs) - 1)))] if gs else 0.0
        lat = [1000 * (x["g"] - x["sent"]) for x in recs if x.get("sent") and lo_t <= x["g"] <= hi_t]
        out = {"config": "stream_ordered" if ordered else "stream", "round": rnd, "consumers": r["results"],
               "spool": r["spool"],
               "delivered_to_trainer_gpu": deliver, "vllm_with_connector": vllm,
               "latency_notice_to_gpu_ms": {"p50": _r(pct(lat, 0.5)), "p99": _r(pct(lat, 0.99)),
                                            "max": _r(max(lat) if lat else None), "n": len(lat),
                                            "window": list(WINDOW),
                                            "all": {"p50": _r(pct(lat_all, 0.5)), "p99": _r(pct(lat_all, 0.99)),
                                                    "max": _r(max(lat_all) if lat_all else None),
                                                    "n": len(lat_all)}},
               "floor": r["results"][0].get("floor")}  # fmt: skip
        if plain_rate and deliver.get("tok_per_s"):
            out["ratio_to_plain"] = round(deliver["tok_per_s"] / plain_rate, 4)
        if plain_rate and vllm.get("tok_per_s"):
            out["vllm_ratio_to_plain"] = round(vllm["tok_per_s"] / plain_rate, 4)
        out["timeline"] = timeline(recs, r["submitted_at"], r["accepted_at"],
                                   min((x.get("stream_opened_at") or math.inf) for x in r["results"]))
        out["breakdown"] = breakdown(recs)
        out["breakdown"]["needed"] = bool(out.get("ratio_to_plain") is None or out["ratio_to_plain"] < 0.985)
        out["stream_pool"] = r["results"][0].get("stream_pool")
        log("(b) where latency goes, p50/p99 ms: " + ", ".join(
            f"{k} {v['p50_ms']:.1f}/{v['p99_ms']:.1f}" for k, v in out["breakdown"].items()
            if isinstance(v, dict) and not k.startswith("connector_")))  # fmt: skip
        log(f"(b) stream: delivered {deliver.get('tok_per_s')} tok/s onto the trainer GPU = {out.get('ratio_to_plain')}"
            f" of plain; vLLM {vllm.get('tok_per_s')} tok/s; notice->GPU p50 {out['latency_notice_to_gpu_ms']['p50']} ms"
            f" p99 {out['latency_notice_to_gpu_ms']['p99']} ms; floor {_floor_ms(out)} ms")
        return out

    def run_train(self, rnd: int, plain_rate: float | None) -> dict:
        a = self.args
        ps = self.prompts[: a.train_samples]
        r = self.run_consumers("train", rnd, ps)
        recs, res = r["records"], dict(r["results"][0])
        if len(r["results"]) > 1:  # DDP: samples/tokens are already all ranks' (all-reduced); waits per rank
            ranks = r["results"]
            res.update(wall_s=max(x["wall_s"] for x in ranks), wait_s=max(x["wait_s"] for x in ranks),
                       wait_frac=round(statistics.mean(x["wait_frac"] for x in ranks), 4), ranks=ranks)  # fmt: skip
            res["yielded_per_rank"] = [sum(1 for x in recs if x.get("rank") == k) for k in range(len(ranks))]
        handed = window_rate([x["y"] for x in recs], a.prompt_len)
        vllm = window_rate([x["sent"] for x in recs if x.get("sent")], a.prompt_len)
        wait = res.get("wait_frac")
        out = {"config": "train", "round": rnd, "trainer": res, "spool": r["spool"],
               "trainer_rate": handed, "vllm_with_connector": vllm,
               "trainer_samples_per_s_overall": round(res["samples"] / res["wall_s"], 2) if res.get("wall_s") else None,
               "trainer_tokens_per_s_overall": round(res["tokens"] / res["wall_s"], 1) if res.get("wall_s") else None}  # fmt: skip
        if plain_rate and vllm.get("tok_per_s"):
            out["vllm_ratio_to_plain"] = round(vllm["tok_per_s"] / plain_rate, 4)
        # The trainer waits little: it is the slower side and vLLM is held back by the spool
        # budget; it waits much: the producer (vLLM + connector + stream) is.
        out["bound_by"] = None if wait is None else ("trainer" if wait < 0.05 else "producer (vLLM + stream)")
        out["spool_within_budget"] = r["spool"]["peak_bytes"] <= r["spool"]["budget_bytes"]
        log(f"(c) train on {res.get('device_used')}: {out['trainer_samples_per_s_overall']} samples/s, "
            f"{out['trainer_tokens_per_s_overall']} tok/s, waiting {wait}, vLLM {vllm.get('tok_per_s')} tok/s, "
            f"peak spool {r['spool']['peak_bytes'] / 2**20:.0f} MiB of {r['spool']['budget_bytes'] / 2**20:.0f}; "
            f"bound by {out['bound_by']}")  # fmt: skip
        return out


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def breakdown(recs: list[dict]) -> dict:
    """Mean, p50 and p99 ms per sample of each stage, from the notices' connector timings and
    the stream's per-sample stamps (``Sample.timings``, one host clock with ``sent_at``):

    * ``sidecar``: notice sent -> the delivery read off the trainer's socket (the sidecar's
      ledger and delivery, and credit: a sample waits here while the stream holds ``credit``),
      in parts: ``sidecar_in`` (to the sidecar's notice socket), ``sidecar_queue`` (applied,
      committed, woken, credit, leased, sent), ``sidecar_to_trainer`` (read off the trainer's socket);
    * ``pool_queue``: received -> a check worker starts on it (all workers busy);
    * ``check`` = ``alloc`` + ``read`` + ``checksum`` + ``finite`` (host) or ``to_device`` (copy
      and finiteness on the GPU with ``--finite-on-device``) + small checks;
    * ``in_order``: checked -> handed to the loop (with ``--ordered``, older samples first; always the
      socket thread's own work: a 33.5 MB tmpfs unlink took ~4 ms there until files were deleted aside);
    * ``copy_to_trainer_gpu``: handed -> on the GPU (a no-op copy with ``--finite-on-device``).
    """
    stages: dict[str, list[float]] = {}

    def add(k: str, v: float | None) -> None:
        if v is not None:
            stages.setdefault(k, []).append(1000 * v)

    for x in recs:
        conn = x.get("conn") or {}
        for k, v in conn.items():
            add(k if k.startswith("sidecar_") else f"connector_{k}", v)
        t = x.get("stream") or {}
        if x.get("sent") is not None and "received" in t:
            add("sidecar", t["received"] - x["sent"])
            if {"sidecar_in", "sidecar_queue"} <= set(conn):
                add("sidecar_to_trainer", t["received"] - x["sent"] - conn["sidecar_in"] - conn["sidecar_queue"])
        if {"received", "started", "checked", "handed"} <= set(t):
            add("pool_queue", t["started"] - t["received"])
            add("check", t["checked"] - t["started"])
            add("in_order", t["handed"] - t["checked"])
        for k in ("alloc_s", "read_s", "checksum_s", "finite_s", "to_device_s"):
            add(f"check_{k[:-2]}", t.get(k))
        if x.get("g") is not None:
            add("copy_to_trainer_gpu", x["g"] - x["y"])
    return {k: {"mean_ms": round(statistics.mean(v), 3), "p50_ms": round(statistics.median(v), 3),
                "p99_ms": round(pct(v, 0.99), 3)} for k, v in stages.items()}  # fmt: skip


def timeline(recs: list[dict], submitted_at: float, accepted_at: float, opened_at: float, parts: int = 10) -> dict:
    """Where the job's start goes and how latency moves through the job: seconds from the job's
    POST to the sidecar's answer, to the consumer's stream opening, to the first notice, the
    first delivery read and the first sample on the GPU; then, by notice order in ``parts``
    equal slices, each slice's first notice (s after the first) and its p50 / max latency and
    sidecar wait (ms). A backlog at the start shows as slow early slices."""
    xs = sorted((x for x in recs if x.get("sent") is not None), key=lambda x: x["sent"])
    if not xs:
        return {}
    t_first = xs[0]["sent"]
    rec_t = [x["stream"]["received"] for x in xs if "received" in (x.get("stream") or {})]
    start = {"sidecar_answered_s": accepted_at - submitted_at,
             "stream_opened_s": opened_at - submitted_at if math.isfinite(opened_at) else None,
             "first_notice_s": t_first - submitted_at,
             "first_received_s": (min(rec_t) - submitted_at) if rec_t else None,
             "first_on_gpu_s": min(x["g"] for x in xs) - submitted_at}
    out = []
    n = len(xs)
    for i in range(parts):
        part = xs[i * n // parts : (i + 1) * n // parts]
        if not part:
            continue
        lat = [1000 * (x["g"] - x["sent"]) for x in part]
        side = [1000 * (x["stream"]["received"] - x["sent"]) for x in part if "received" in (x.get("stream") or {})]
        out.append({"from_s": part[0]["sent"] - t_first, "n": len(part), "latency_p50_ms": _r(pct(lat, 0.5)),
                    "latency_max_ms": _r(max(lat)), "sidecar_p50_ms": _r(pct(side, 0.5)) if side else None,
                    "sidecar_max_ms": _r(max(side)) if side else None})  # fmt: skip
    return {"start_s": {k: _r(v, 3) if v is not None else None for k, v in start.items()}, "by_notice_order": out}


def prompts(n: int, plen: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab - 3, size=(n, plen)).tolist()


def dry_run(args: argparse.Namespace, model: str) -> int:
    """The command lines this split would start, without starting anything."""
    from hsstream import launch
    from hsstream.up import hsstream_vllm_cli

    print("(a) plain vLLM, CUDA_VISIBLE_DEVICES=" + args.vllm_gpus + ":")
    print("  " + " ".join(launch.vllm_args(plain_options(args, model, 8000))))
    cli = hsstream_vllm_cli(model, args.layers, "127.0.0.1", 8000, max_model_len=args.max_model_len,
                            gpu_memory_utilization=args.gpu_mem_util, enforce_eager=True,
                            extra=["--served-model-name", "verifier", *vllm_flags(args)])  # fmt: skip
    i = cli.index("--") if "--" in cli else len(cli)
    r = subprocess.run([sys.executable, "-m", "hsstream", "vllm", *cli[:i], "--dry-run", *cli[i:]],
                       env=launch.child_env({"HSSTREAM_SPOOL_DIR": "/dev/shm/hsstream-online"}), capture_output=True,
                       text=True, cwd=str(ROOT))  # fmt: skip
    print(f"(b)/(c) vLLM + connector (hsstream vllm), CUDA_VISIBLE_DEVICES={args.vllm_gpus}:")
    print("  " + (r.stdout.strip() or r.stderr.strip()))
    ranks = args.trainer_gpu_list[: args.trainer_nproc]
    print(f"consumers: (b) one per trainer GPU {args.trainer_gpu_list}; (c) trainer on {ranks[0]}"
          if args.trainer_nproc == 1 else f"consumers: (b) one per trainer GPU {args.trainer_gpu_list}; "
          f"(c) {args.trainer_nproc} DDP ranks (torchrun) on {ranks}")  # fmt: skip
    return r.returncode


def main() -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-gpus", default="0", help="CUDA devices of vLLM, e.g. 0 or 0,1")
    ap.add_argument("--trainer-gpus", default="1", help="CUDA devices of the consumers / trainer, e.g. 1 or 2,3")
    ap.add_argument("--vllm-tp", type=int, default=1, help="tensor-parallel size; the vLLM GPUs / TP = DP engines")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--samples", type=int, default=2048, help="samples for (a) and (b)")
    ap.add_argument("--train-samples", type=int, default=2048, help="samples for (c), within --consumer-seconds")
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight: (a)'s client and the sidecar")
    ap.add_argument("--credit", type=int, default=16, help="samples a consumer may hold undelivered")
    ap.add_argument("--stream-workers", type=int, default=8,
                    help="threads the stream reads and checks samples on (0: the iterating thread, as before)")
    ap.add_argument("--trainer-nproc", type=int, default=1,
                    help="(c): DDP trainer ranks on the first N --trainer-gpus (torchrun, as hsstream train --nproc)")
    ap.add_argument("--ordered", action="store_true",
                    help="the stream yields in delivery order (default: each sample as soon as it is checked)")
    ap.add_argument("--finite-on-device", action="store_true",
                    help="(b): the stream copies each sample to the trainer GPU and checks finiteness there")
    ap.add_argument("--checksum", default="blake3", choices=("blake3", "xxh3-128"),
                    help="the connector's checksum kind (named in each notice; the stream checks that kind)")
    ap.add_argument("--spool-budget-gib", type=float, default=8.0)
    ap.add_argument("--writer-threads", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--draft", default="eagle3", help="(c)'s draft: a name in trainer_client.drafts (eagle3, peagle, dflash, dspark)")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="peagle/dflash: the mask token (default: the verifier's last vocabulary id; random heads have no zero row)")
    ap.add_argument("--block-size", type=int, default=4, help="dflash: tokens per block")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-mem-util", type=float, default=None, help="default 0.85 (GPU), 0.2 (CPU)")
    ap.add_argument("--model-dir", default=None, help="verifier config + heads (written if absent)")
    ap.add_argument("--start-timeout", type=float, default=None, help="engine/consumer start limit, s")
    ap.add_argument("--config-timeout", type=float, default=None, help="(a)'s requests limit, s")
    ap.add_argument("--consumer-seconds", type=float, default=None, help="(b)/(c) consumers stop after this")
    ap.add_argument("--config-grace", type=float, default=60.0, help="beyond --consumer-seconds before a kill")
    ap.add_argument("--warm-shm-mib", type=int, default=16384)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shape, few samples, trainer on CPU")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines of this split and exit")
    ap.add_argument("--name", default=None, help="result file under bench/results/, e.g. online_gpu_h200x2.json")
    ap.add_argument("--share-gpus", action="store_true",
                    help="allow vLLM and the trainer on the same GPU (one-GPU machines; they compete for it)")
    ap.add_argument("--consumer", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        consumer_main(*args.consumer)

    from hsstream import launch

    cpu = launch.is_cpu_build()
    if cpu and not args.smoke and not args.dry_run:
        log("no CUDA device: running the CPU smoke configuration (--smoke)")
        args.smoke = True
    shape = C.SMOKE if args.smoke else C.QWEN3_8B
    n = shape["num_hidden_layers"]
    args.layers = LAYERS if not args.smoke else [2, n // 2, n - 3, n]
    if args.draft in ("peagle", "dflash", "dspark") and args.mask_token_id is None:
        args.mask_token_id = shape["vocab_size"] - 1  # a random heads' row: never zero, and prompts() never draws it
    if args.smoke:
        for k, v in (("samples", 48), ("train_samples", 24), ("warmup", 4), ("prompt_len", 256), ("concurrency", 8),
                     ("credit", 4), ("spool_budget_gib", 0.05), ("writer_threads", 2), ("max_model_len", 512)):
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    args.gpu_mem_util = args.gpu_mem_util or (0.2 if cpu else 0.85)
    args.start_timeout = args.start_timeout or (600 if cpu else 240)
    args.config_timeout = args.config_timeout or (600 if cpu else 180)
    args.consumer_seconds = args.consumer_seconds or (400 if cpu else 120)
    args.vllm_gpu_list = [g for g in args.vllm_gpus.split(",") if g != ""]
    args.trainer_gpu_list = [g for g in args.trainer_gpus.split(",") if g != ""]
    if set(args.vllm_gpu_list) & set(args.trainer_gpu_list) and not cpu and not args.share_gpus:
        ap.error(f"--vllm-gpus {args.vllm_gpus} and --trainer-gpus {args.trainer_gpus} overlap "
                 "(--share-gpus to run both on the same GPUs, with --gpu-mem-util leaving the trainer room)")
    if args.trainer_nproc < 1 or (not cpu and args.trainer_nproc > len(args.trainer_gpu_list)):
        ap.error(f"--trainer-nproc {args.trainer_nproc}: one rank per GPU of --trainer-gpus {args.trainer_gpus}")
    try:
        launch.parallel_args(len(args.vllm_gpu_list), args.vllm_tp)
    except ValueError as e:
        ap.error(str(e))
    model = str(Path(args.model_dir or ("/tmp/hsstream-online-smoke" if args.smoke else "/tmp/hsstream-qwen3-8b-heads"))
                .absolute())  # fmt: skip
    if args.dry_run:
        if not (Path(model) / "config.json").exists():
            Path(model).mkdir(parents=True, exist_ok=True)
            (Path(model) / "config.json").write_text(json.dumps(shape))
        return dry_run(args, model)

    name = args.name or ("online_gpu_smoke_cpu.json" if args.smoke else "online_gpu_h200x2.json")
    name = name if name.endswith(".json") else f"{name}.json"  # a bare name still lands as JSON
    out_dir = ROOT / "bench" / "results"
    o = Orchestrator(args)
    o.shape, o.model = shape, model
    doc = o.doc
    doc.update({
        "benchmark": "online_gpu", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(["python bench/online_gpu.py", *sys.argv[1:]]), "device": _gpu_names(),
        "split": {"vllm_gpus": args.vllm_gpu_list, "trainer_gpus": args.trainer_gpu_list, "vllm_tp": args.vllm_tp,
                  "vllm_flags": vllm_flags(args)},
        "model": {"shape": "smoke" if args.smoke else "Qwen3-8B", "hidden_size": shape["hidden_size"],
                  "num_hidden_layers": n, "vocab_size": shape["vocab_size"], "layers": args.layers,
                  "vllm_weights": "load_format=dummy", "trainer_reads": "random embed_tokens / norm / lm_head"},
        "args": {k: v for k, v in vars(args).items() if k not in ("consumer",)},
        "window": f"steady state: completions from the {WINDOW[0]:.0%} to the {WINDOW[1]:.0%} quantile",
        "runs": [], "errors": [],
    })  # fmt: skip

    def save() -> None:
        for d in [out_dir] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(json.dumps(doc, indent=1, default=str))

    def on_signal(signum, _frame) -> None:  # noqa: ANN001
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    rc = 1
    try:
        t0 = time.perf_counter()
        hc = [sys.executable, "-m", "bench.checkpoints", "--out", model, "--shape", "smoke" if args.smoke else "qwen3-8b",
              "--heads-only"]  # fmt: skip
        subprocess.run(hc, env=o.env(args.trainer_gpu_list[0]), cwd=str(ROOT), check=True, timeout=300)
        log(f"verifier heads ready in {time.perf_counter() - t0:.0f} s: {model}")
        if not args.smoke and Path("/dev/shm").exists():
            log(f"pre-touching {args.warm_shm_mib} MiB of /dev/shm (guest RAM grows on first touch)")
            subprocess.run(["dd", "if=/dev/zero", "of=/dev/shm/hsstream-warm", "bs=1M", f"count={args.warm_shm_mib}"],
                           capture_output=True, timeout=120)  # fmt: skip
            Path("/dev/shm/hsstream-warm").unlink(missing_ok=True)
        o.prompts = prompts(args.samples, args.prompt_len, shape["vocab_size"], 0)
        o.warm_prompts = prompts(args.warmup, args.prompt_len, shape["vocab_size"], 1)
        from trainer_client.train import vocab as V

        V.save_token_counts(V.count_tokens(o.prompts), o.work / "token_counts.json")
        plain_rate = None
        for rnd in range(args.rounds):
            for cfg in args.configs:
                t1 = time.perf_counter()
                try:
                    if cfg == "plain":
                        run = o.run_plain(rnd)
                        plain_rate = run["rate"].get("tok_per_s") or plain_rate
                    else:
                        if o.stack is None:
                            doc.setdefault("stack_start_s", []).append(round(o.start_stack(rnd), 1))
                            log(f"stack warm-up: {len(o.warm_prompts)} samples")
                            o.run_consumers("deliver", rnd, o.warm_prompts)
                        run = (o.run_train(rnd, plain_rate) if cfg == "train"
                               else o.run_stream(rnd, plain_rate, ordered=True if cfg == "stream_ordered" else None))
                        run["kv_cache_tokens"] = kv_tokens(o.stack.workdir / "vllm.log")
                    run["seconds"] = round(time.perf_counter() - t1, 1)
                    doc["runs"].append(run)
                except Exception as e:  # noqa: BLE001 - record it, clean up, go on with the next configuration
                    log(f"configuration {cfg} (round {rnd}) FAILED: {e}")
                    doc["errors"].append({"config": cfg, "round": rnd, "error": str(e)[:3000]})
                    if cfg != "plain":
                        o.stop_stack()
                save()
            o.stop_stack()
        summarize(doc)
        rc = 0 if not doc["errors"] and doc["runs"] else 1
    except KeyboardInterrupt as e:
        doc["errors"].append({"error": f"interrupted: {e}"})
    finally:
        o.stop_children()
        o.stop_stack()
        shutil.rmtree(o.work, ignore_errors=True)
        save()
    log(f"wrote {out_dir / name}")
    return rc


def _floor_ms(run: dict) -> float | None:
    """The faster of the two measured ways to get one sample from tmpfs onto the GPU, alone (the
    parts read at once, or safetensors' map + torch's multi-threaded copy into pinned memory):
    which wins depends on the host."""
    f = run.get("floor") or {}
    ways = [v for v in (f.get("total_parallel_read_ms_p50"), f.get("total_ms_p50")) if v is not None]
    return min(ways) if ways else None


def summarize(doc: dict) -> None:
    runs = doc["runs"]

    def mean(cfg: str, get) -> float | None:  # noqa: ANN001
        xs = [get(r) for r in runs if r["config"] == cfg]
        xs = [x for x in xs if x is not None]
        return round(statistics.mean(xs), 4) if xs else None

    plain = mean("plain", lambda r: r["rate"].get("tok_per_s"))
    s = {
        "plain_tok_per_s": plain,
        "stream_delivered_tok_per_s": mean("stream", lambda r: r["delivered_to_trainer_gpu"].get("tok_per_s")),
        "stream_ratio_to_plain": mean("stream", lambda r: r.get("ratio_to_plain")),
        "stream_vllm_ratio_to_plain": mean("stream", lambda r: r.get("vllm_ratio_to_plain")),
        "latency_p50_ms": mean("stream", lambda r: r["latency_notice_to_gpu_ms"]["p50"]),
        "latency_p99_ms": mean("stream", lambda r: r["latency_notice_to_gpu_ms"]["p99"]),
        "ordered_latency_p50_ms": mean("stream_ordered", lambda r: r["latency_notice_to_gpu_ms"]["p50"]),
        "ordered_latency_p99_ms": mean("stream_ordered", lambda r: r["latency_notice_to_gpu_ms"]["p99"]),
        # The floor: one sample from tmpfs onto the GPU, alone, the faster of the two ways measured.
        "floor_ms": mean("stream", _floor_ms),
        "train_samples_per_s": mean("train", lambda r: r.get("trainer_samples_per_s_overall")),
        "train_tokens_per_s": mean("train", lambda r: r.get("trainer_tokens_per_s_overall")),
        "train_wait_frac": mean("train", lambda r: r["trainer"].get("wait_frac")),
        "train_vllm_ratio_to_plain": mean("train", lambda r: r.get("vllm_ratio_to_plain")),
        "train_bound_by": next((r["bound_by"] for r in runs if r["config"] == "train"), None),
        "train_device_used": next((r["trainer"].get("device_used") for r in runs if r["config"] == "train"), None),
        "peak_spool_bytes": max((r["spool"]["peak_bytes"] for r in runs if "spool" in r), default=None),
        "spool_budget_bytes": next((r["spool"]["budget_bytes"] for r in runs if "spool" in r), None),
        "kv_cache_tokens_plain": next((r["kv_cache_tokens"] for r in runs if r["config"] == "plain"), None),
        "kv_cache_tokens_extraction": next((r["kv_cache_tokens"] for r in runs if r["config"] != "plain"), None),
    }
    doc["summary"] = s
    rows = [
        ("(a) plain vLLM prefill", f"{s['plain_tok_per_s']} tok/s", "1.000"),
        ("(b) delivered onto the trainer GPU", f"{s['stream_delivered_tok_per_s']} tok/s", s["stream_ratio_to_plain"]),
        ("(b) vLLM with our connector", "", s["stream_vllm_ratio_to_plain"]),
        ("(b) notice -> trainer GPU latency", f"p50 {s['latency_p50_ms']} ms, p99 {s['latency_p99_ms']} ms",
         f"floor {s['floor_ms']} ms"),
        ("(b) the same, yielded in delivery order", f"p50 {s['ordered_latency_p50_ms']} ms, "
         f"p99 {s['ordered_latency_p99_ms']} ms", "stream_ordered"),
        ("(c) Eagle-3 trainer", f"{s['train_samples_per_s']} samples/s, {s['train_tokens_per_s']} tok/s",
         f"waits {s['train_wait_frac']}"),
        ("(c) vLLM meanwhile", "", s["train_vllm_ratio_to_plain"]),
        ("(c) bound by", str(s["train_bound_by"]), f"trainer on {s['train_device_used']}"),
        ("peak spool / budget", f"{s['peak_spool_bytes']} B", f"{s['spool_budget_bytes']} B"),
        ("KV cache tokens plain / extraction", f"{s['kv_cache_tokens_plain']}", f"{s['kv_cache_tokens_extraction']}"),
    ]  # fmt: skip
    print("\n| measure | value | ÷ plain / note |\n|---|---|---|")
    for a, b, c in rows:
        print(f"| {a} | {b} | {c} |")
    print(flush=True)


def _gpu_names() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().replace("\n", ", ") or "cpu"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "cpu"


if __name__ == "__main__":
    sys.exit(main())
