"""``bench/online_gpu/online_gpu.py``'s consumer child, on a trainer GPU: (b) deliver onto the GPU, (c) train.

Runs in its own process (``python bench/online_gpu/online_gpu.py --consumer SPEC OUT``, under torchrun
for several ranks), so it holds CUDA and the stream while the orchestrator holds neither: it
reads its spec from a file, says when it is ready, waits for its job, records each sample,
writes its result and exits.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path


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
            # Only the copy stays resident: with the arena layout (and no device copy by the
            # stream) ``s`` and ``hs`` are views of the sample's slot, which the sidecar frees only
            # once they are gone; held into the next turn, each keeps a slot of a full arena.
            del s, hs, nt
            n += 1
            if n >= spec["n_samples"] or time.monotonic() > t_end:
                res["stopped"] = "time limit" if n < spec["n_samples"] else "all samples"
                break
    res["samples"] = n
    res["stream_stats"] = dict(stream.stats)
    res["stream_pool"] = {"workers": stream.workers, **stream.pool_stats, "finite_on_device": bool(on_dev),
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
              draft_options={k: v for k, v in (("mask_token_id", spec.get("mask_token_id")),
                                              ("block_size", spec.get("block_size", 4))) if v is not None})  # fmt: skip
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
        probe.append(drained_probe(spec["api"], [job], spec.get("token")))
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
