"""Two trainer ranks (real gloo process group, in-memory streams): the update and the stop.

* token weighting: rank 0 trains on sample A, rank 1 on sample B (different lengths and loss
  masks); the all-reduced gradient must equal one process's gradient on A and B packed in one
  step (with one TTT step the loss is then exactly the token-weighted mean over both);
* ranks with unequal data (one runs dry, idle yields on the way) step together to the end,
  keep identical weights, rank 0 alone writes checkpoints and each rank acknowledges each of
  its samples once: ``bench.online_gpu.gpu_smoke`` on CPU, the same check the GPU host runs;
* a rank that a native library aborts prints its threads' Python stacks (faulthandler).

The same with real streams from a real sidecar and vLLM: tests/integration/trainer_client/test_trainer_e2e.py.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from connector import protocol as P
from trainer_client.stream import Sample

LAYERS = [2, 6, 9, 12]


def _samples(verifier: str) -> list[Sample]:
    from hsstream.tiny_model import hf_hidden_states

    out = []
    for i, (t, seed) in enumerate(((21, 1), (38, 2))):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 500, (t,), generator=g)
        hs = hf_hidden_states(verifier, ids.tolist(), LAYERS).to(torch.bfloat16)
        mask = torch.rand(t, generator=g) > 0.3  # ranks get different numbers of loss tokens
        out.append(Sample(P.SampleKey(job="ddp", index=i), ids, hs, LAYERS, 12, mask))
    return out


def _cfg(verifier: str, out: str, **kw):  # noqa: ANN202
    from trainer_client.eagle3 import TrainConfig

    base = dict(verifier=verifier, out_dir=out, draft_vocab_size=128, draft_options={"ttt_steps": 1}, grad_clip=1e9, max_steps=1,
                progress=False, tensorboard=False, threads=1, device="cpu", warmup_steps=1)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _grad_rank(rank: int, verifier: str, out: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    from trainer_client.eagle3 import Eagle3OnlineTrainer
    from trainer_client.train.distributed import World
    from bench.online_gpu.gpu_smoke import MemoryStream

    world = World.from_env(torch.device("cpu"))
    try:
        smp = _samples(verifier)
        tr = Eagle3OnlineTrainer(_cfg(verifier, out), {t: 1 for t in range(128)}, world=world)
        tr.train(MemoryStream([smp[rank]], idle_every=0))
        torch.save(torch.cat([p.grad.reshape(-1) for p in tr.stepper.params]), Path(out) / f"grad{rank}.pt")
    finally:
        world.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_gradient_is_the_token_weighted_gradient_of_both_samples(tiny_model, tmp_path):
    from trainer_client.eagle3 import Eagle3OnlineTrainer
    from bench.online_gpu.gpu_smoke import MemoryStream

    out = tmp_path / "ddp"
    mp.spawn(_grad_rank, args=(tiny_model, str(out), _port()), nprocs=2, join=True)
    g0, g1 = torch.load(out / "grad0.pt"), torch.load(out / "grad1.pt")
    assert torch.equal(g0, g1)  # one all-reduced gradient on both ranks
    smp = _samples(tiny_model)
    assert int(smp[0].loss_mask[1:].sum()) != int(smp[1].loss_mask[1:].sum())  # unequal weights matter
    one = Eagle3OnlineTrainer(_cfg(tiny_model, str(tmp_path / "one"), samples_per_step=2), {t: 1 for t in range(128)})
    one.train(MemoryStream(smp, idle_every=0))
    ref = torch.cat([p.grad.reshape(-1) for p in one.stepper.params])
    assert ref.abs().max() > 0
    err = float((g0 - ref).abs().max() / ref.abs().max())
    assert err < 1e-4, err
    # and an unweighted mean of the two ranks' gradients would not pass
    from trainer_client.train.checkpointing import CKPT_LOG

    saves = [line for line in (out / CKPT_LOG).read_text().splitlines() if '"save"' in line]
    assert len(saves) == 1 and '"rank": 0' in saves[0]


def test_ranks_with_unequal_data_stop_together_with_one_writer_and_identical_weights():
    from bench.online_gpu.gpu_smoke import main

    assert main(["--device", "cpu", "--nproc", "2", "--steps", "24", "--checkpoint-every", "10"]) == 0


_ABORTING_RANK = """
import os, torch
from trainer_client.train.distributed import World
w = World.from_env(torch.device("cpu"))
assert w.size == 2
def where_it_aborted():
    os.abort()  # as a native library's std::terminate would
where_it_aborted()
"""


def test_a_rank_killed_by_a_native_abort_prints_where_each_thread_was():
    """A rank that a native library aborts (SIGABRT) says where: World.from_env turns on
    faulthandler in each rank, whose stacks name the Python frame it died in."""
    import subprocess
    import sys

    port = _port()
    root = Path(__file__).resolve().parents[3]
    procs = [subprocess.Popen([sys.executable, "-c", _ABORTING_RANK], cwd=root, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(root), "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]  # fmt: skip
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == -6, (p.returncode, err[-2000:])  # the abort still ends it (SIGABRT)
            assert "Fatal Python error: Aborted" in err, err[-2000:]
            assert "in where_it_aborted" in err, err[-2000:]
    finally:
        for p in procs:  # one stuck in the rendezvous does not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()


def _stop_rank(rank: int, verifier: str, out: str, port: int) -> None:
    """Rank 0 alone gets SIGTERM after its 5th sample; both must stop at the same step, saved."""
    import json
    import signal

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    from bench.online_gpu.gpu_smoke import MemoryStream
    from hsstream.launch import exit_0_on_stop
    from trainer_client.eagle3 import Eagle3OnlineTrainer
    from trainer_client.train.distributed import World

    exit_0_on_stop()  # as `hsstream train` does first

    class Signalled(MemoryStream):
        def __iter__(self):  # noqa: ANN204
            for i, s in enumerate(super().__iter__()):
                if rank == 0 and s is not None and s.key.index == 5:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield s

    world = World.from_env(torch.device("cpu"))
    smp = _samples(verifier)
    keys = [Sample(P.SampleKey(job=f"r{rank}", index=i), s.token_ids, s.hidden_states, s.layer_ids, 12, s.loss_mask)
            for i, s in enumerate(smp * 10)]  # fmt: skip
    stream = Signalled(keys, idle_every=3)
    tr = Eagle3OnlineTrainer(_cfg(verifier, out, max_steps=None, checkpoint_every=1000), {t: 1 for t in range(128)},
                             world=world)  # fmt: skip
    code = None
    try:
        tr.train(stream)
    except SystemExit as e:
        code = e.code
    finally:
        Path(out, f"stop{rank}.json").write_text(json.dumps({"step": tr.step, "code": code, "acked": stream.acked}))
        world.close()


def test_a_stop_asked_on_one_rank_stops_both_at_the_same_step_saved(tiny_model, tmp_path):
    import json

    from trainer_client.train import checkpoints as M

    out = tmp_path / "ddp"
    mp.spawn(_stop_rank, args=(tiny_model, str(out), _port()), nprocs=2, join=True, start_method="spawn")
    r = [json.loads((out / f"stop{k}.json").read_text()) for k in range(2)]
    assert r[0]["code"] == r[1]["code"] == 0 and r[0]["step"] == r[1]["step"] >= 5  # together, cleanly
    assert M.list_checkpoints(out)[-1][0] == r[0]["step"]  # every step trained is saved, once
    for k in range(2):  # each rank acknowledged what it trained, no more
        assert r[k]["acked"] == [f"r{k}/0/{i}" for i in range(r[k]["step"])], r[k]["acked"]
