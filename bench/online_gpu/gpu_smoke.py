"""A few training steps on a device, from an in-memory stream: does the device path work?

    python -m bench.online_gpu.gpu_smoke                      # cuda if available, else cpu
    python -m bench.online_gpu.gpu_smoke --device cuda --nproc 2   # two ranks, NCCL

No sidecar and no vLLM: the tiny verifier (built offline) gives the frozen parts, the samples
are random bf16 hidden states of its shape, pinned on CUDA as the stream pins them, cycled so
that the draft can fit them. It checks what the real run relies on: the draft and the
verifier's frozen parts on the device in float32, the step under bf16 autocast on CUDA, every
batch copied through the side stream (prefetched while the previous step ran), the loss going
down, every sample acknowledged exactly once after a checkpoint, and with several ranks the
weights identical on every rank and one checkpoint writer. It prints ``GPU_SMOKE_OK`` and a
JSON summary, or exits non-zero naming what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

from connector import protocol as P
from trainer_client.stream import Sample


class MemoryStream:
    """Stands in for HiddenStateStream: yields samples, an idle ``None`` now and then, and
    records acknowledgements (``ack_through``) so double or missing acks show."""

    def __init__(self, samples: list[Sample], idle_every: int = 5) -> None:
        self.samples = samples
        self.idle_s = 0.01
        self.idle_every = idle_every
        self.used: list[P.SampleKey] = []
        self.acked: list[str] = []

    def __iter__(self):  # noqa: ANN204
        for i, s in enumerate(self.samples):
            if self.idle_every and i % self.idle_every == self.idle_every - 1:
                yield None
            self.used.append(s.key)
            yield s

    def keepalive(self) -> None:
        pass

    def ack_through(self, key: P.SampleKey) -> None:
        i = self.used.index(key)
        self.acked.extend(str(k) for k in self.used[: i + 1])
        del self.used[: i + 1]


def make_samples(verifier: str, n: int, distinct: int, rank: int, pin: bool, seed: int = 0) -> list[Sample]:
    from trainer_client.train.checkpoints import verifier_text_config

    c = verifier_text_config(verifier)
    nl, h, v = int(c["num_hidden_layers"]), int(c["hidden_size"]), int(c["vocab_size"])
    layers = [2, nl // 2, nl - 3, nl]
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    base = []
    for i in range(distinct):
        t = 48 + 16 * ((i + rank) % 4)  # ranks get different token counts
        hs = torch.randn((t, len(layers), h), generator=g).to(torch.bfloat16)
        ids = torch.randint(0, v, (t,), generator=g)
        base.append((ids, hs))
    out = []
    for i in range(n):
        ids, hs = base[i % distinct]
        if pin:
            ids, hs = ids.pin_memory(), hs.pin_memory()
        out.append(Sample(P.SampleKey(job=f"smoke{rank}", index=i), ids, hs, layers, nl, None))
    return out


def run_rank(args: argparse.Namespace, out_dir: str) -> dict:
    from hsstream.tiny_model import build_tiny_verifier
    from trainer_client.train.checkpointing import CKPT_LOG
    from trainer_client.train.config import TrainConfig, resolve_device
    from trainer_client.train.distributed import World
    from trainer_client.train.checkpoints import verifier_text_config
    from trainer_client.eagle3 import Eagle3OnlineTrainer

    verifier = str(build_tiny_verifier())
    world = World.from_env(resolve_device(args.device, local_rank=World.env_local_rank(), world_size=World.env_size()))
    try:
        cfg = TrainConfig(verifier=verifier, out_dir=out_dir, draft_vocab_size=256, lr=3e-3, warmup_steps=5,
                          checkpoint_every=args.checkpoint_every, progress=False, tensorboard=False, threads=1,
                          device=args.device, schedule="constant", log_every=10**9)  # fmt: skip
        v = int(verifier_text_config(verifier)["vocab_size"])
        tr = Eagle3OnlineTrainer(cfg, {t: v - t for t in range(v)}, world=world)  # the same maps on every rank
        n = args.steps + 3 * world.rank  # unequal amounts: a rank runs dry first and must keep stepping
        stream = MemoryStream(make_samples(verifier, n, args.distinct, world.rank, pin=tr.device.type == "cuda"))
        t0 = time.perf_counter()
        res = tr.train(stream)
        wall = time.perf_counter() - t0
        p = next(tr.model.parameters())
        checksum = float(sum(float(q.detach().double().sum()) for q in tr.model.parameters() if q.requires_grad))
        sums = world.gather(checksum)
        losses = [h["loss"] for h in res.history]
        k = max(1, len(losses) // 5)
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        fails = []
        if str(p.device) != str(tr.device) or p.dtype != torch.float32:
            fails.append(f"draft on {p.device} {p.dtype}, expected {tr.device} float32")
        if tr.device.type == "cuda" and tr.autocast != torch.bfloat16:
            fails.append(f"autocast {tr.autocast}, expected bfloat16 on CUDA")
        for name in ("embed_tokens", "verifier_lm_head", "verifier_norm"):
            q = next(getattr(tr.model, name).parameters())
            if str(q.device) != str(tr.device) or q.requires_grad:
                fails.append(f"{name} on {q.device}, requires_grad={q.requires_grad}")
        if tr.device.type == "cuda" and tr.data_stats.get("staged") != n:  # one sample per batch here
            fails.append(f"{tr.data_stats.get('staged')} of {n} batches went through the side stream")
        if not last < 0.8 * first:
            fails.append(f"loss did not go down: first {first:.4f}, last {last:.4f}")
        if sorted(stream.acked) != sorted(str(s.key) for s in stream.samples) or len(set(stream.acked)) != n:
            fails.append(f"acked {len(stream.acked)} keys ({len(set(stream.acked))} distinct) of {n}")
        if max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):  # type: ignore[type-var, operator]
            fails.append(f"weights differ across ranks: {sums}")
        if world.is_writer:
            log = [json.loads(x) for x in (Path(out_dir) / CKPT_LOG).read_text().splitlines()]
            writers = {(r["rank"], r["pid"]) for r in log if r["event"] == "save"}
            if writers != {(0, os.getpid())}:
                fails.append(f"checkpoint writers {writers}")
        return {"rank": world.rank, "world_size": world.size, "device": str(tr.device), "autocast": str(tr.autocast),
                "steps": res.steps, "samples": res.samples, "loss_first": round(first, 4), "loss_last": round(last, 4),
                "steps_per_s": round(res.steps / wall, 2), "wait_frac": round(res.wait_s / wall, 4) if wall else None,
                "staged_on_side_stream": tr.data_stats.get("staged"), "fails": fails}  # fmt: skip
    finally:
        world.close()


def _rank_main(rank: int, args: argparse.Namespace, port: int, out_dir: str, results: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    r = run_rank(args, out_dir)
    Path(results, f"rank{rank}.json").write_text(json.dumps(r))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--distinct", type=int, default=6, help="distinct samples, cycled")
    ap.add_argument("--checkpoint-every", type=int, default=25)
    args = ap.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="hsstream-gpu-smoke-")
    results = tempfile.mkdtemp(prefix="hsstream-gpu-smoke-res-")
    if args.nproc > 1:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank_main, args=(args, port, out_dir, results), nprocs=args.nproc, join=True)
        rows = [json.loads(Path(results, f"rank{r}.json").read_text()) for r in range(args.nproc)]
    else:
        rows = [run_rank(args, out_dir)]
    fails = [f"rank {r['rank']}: {f}" for r in rows for f in r["fails"]]
    print(json.dumps({"ranks": rows, "out_dir": out_dir}, indent=None))
    if fails:
        print("GPU_SMOKE_FAILED", *fails, sep="\n  ")
        return 1
    print(f"GPU_SMOKE_OK device={rows[0]['device']} autocast={rows[0]['autocast']} ranks={len(rows)} "
          f"steps={rows[0]['steps']} loss {rows[0]['loss_first']} -> {rows[0]['loss_last']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
