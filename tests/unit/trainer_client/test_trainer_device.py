"""The trainer's device path on a CPU machine: device choice, prefetching, the CUDA copy protocol.

The CUDA calls themselves (``CudaOps``) need a GPU (``python -m bench.online_gpu.gpu_smoke``
on one); here a recording stand-in takes their place, so the order the data path relies on is
checked: copies and packing on the side stream, then the event; the compute side waits for the
event before it gets the tensors, and every tensor is handed over to the compute stream.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.unit.trainer_client.test_trainer_loop import ListStream, cfg, counts_of, samples  # noqa: F401 - fixture
from trainer_client.eagle3 import Eagle3OnlineTrainer
from trainer_client.train.config import DeviceError, resolve_autocast, resolve_device
from trainer_client.train.data_path import BatchSource, DeviceCopier, Prefetcher
from trainer_client.drafts.base import bucket_length, pad_to_bucket
from trainer_client.drafts.eagle3 import pack


def test_device_auto_is_cpu_without_cuda_and_cuda_is_refused_clearly():
    # this machine and CI have no CUDA; on a GPU host (docs/gpu-plan.md runs these tests there) "auto" is cuda:0
    # and an index past the visible devices is what is refused
    if torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cuda", 0)
        with pytest.raises(DeviceError, match="visible"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(DeviceError, match="no CUDA device"):
            resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="use auto, cpu, cuda or cuda:N"):
        resolve_device("gpu0")
    assert resolve_autocast("auto", torch.device("cpu")) is None
    assert resolve_autocast("auto", torch.device("cuda", 0)) == torch.bfloat16  # speculators' choice on GPUs
    with pytest.raises(ValueError, match="use auto, bf16 or none"):
        resolve_autocast("fp8", torch.device("cpu"))


def test_hsstream_train_refuses_a_device_it_cannot_use(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from hsstream.cli import app

    # no CUDA here: "cuda" is refused; on a GPU host, an index past the visible devices is
    cuda = torch.cuda.is_available()
    device, says = (f"cuda:{torch.cuda.device_count()}", "visible") if cuda else ("cuda", "no CUDA device")
    r = CliRunner().invoke(app, ["train", "--model", tiny_model, "--out", str(tmp_path / "r"), "--job", "x",
                                 "--device", device, "--no-progress"])  # fmt: skip
    assert r.exit_code == 2 and says in r.output, r.output


def test_prefetching_ahead_changes_nothing_but_the_order_of_work(tiny_model, samples, tmp_path):  # noqa: F811
    """Batch k+1 fetched (and copied) while step k runs: same losses, same acks at the same steps."""
    runs = {}
    for depth in (0, 1, 2):
        out = tmp_path / f"p{depth}"
        stream = ListStream(samples[:12])
        acks = []
        stream.on_ack = lambda k, acks=acks, stream=stream: acks.append((str(k), len(stream.used)))
        tr = Eagle3OnlineTrainer(cfg(tiny_model, out, prefetch=depth), counts_of(samples))
        res = tr.train(stream)
        runs[depth] = ([(h["loss"], h["grad_norm"], h["top1_0"]) for h in res.history], [k for k, _ in acks], res)
        assert [str(k) for k in stream.acked] == [str(s.key) for s in samples[:12]]
    assert runs[0][0] == runs[1][0] == runs[2][0]  # bit-identical numbers
    assert runs[0][1] == runs[1][1] == runs[2][1] == ["unit/0/3", "unit/0/7", "unit/0/11"]
    cuda = torch.cuda.is_available()  # "auto": cuda:0 with bf16 autocast on a GPU host (docs/gpu-plan.md)
    assert runs[1][2].steps == 12 and runs[1][2].device == ("cuda:0" if cuda else "cpu")
    assert runs[1][2].autocast == ("bfloat16" if cuda else None)


class RecordingOps:
    """Stands in for CudaOps on a CPU: records what the data path asks the device to do."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.in_side = False

    @contextlib.contextmanager
    def side(self):
        self.calls.append("side:enter")
        self.in_side = True
        try:
            yield
        finally:
            self.in_side = False
            self.calls.append("side:exit")

    def to_device(self, t):
        assert self.in_side, "host->device copy outside the side stream"
        self.calls.append("copy")
        return t.clone()

    def record(self):
        assert self.in_side
        self.calls.append("record")
        return object()

    def wait(self, ev):
        self.calls.append("wait")

    def hand_over(self, t):
        self.calls.append("hand_over")


def test_copies_and_packing_run_on_the_side_stream_and_are_handed_over_after_the_event(samples):  # noqa: F811
    ops = RecordingOps()
    src = BatchSource(iter(samples[:4] + [None] + samples[4:5]), check=lambda s: None,
                      already_trained=lambda k: k == "unit/0/1", samples_per_step=2, max_tokens_per_step=10**6)  # fmt: skip
    copier = DeviceCopier(torch.device("cpu"), [2, 6, 9], ops)  # type: ignore[arg-type]
    pre = Prefetcher(src, copier, depth=1)
    first = pre.take()  # fetched now: samples 0 and 2 (1 is in the weights already)
    assert first is not None and first.host.keys == ["unit/0/0", "unit/0/2"] and first.host.settled == ["unit/0/1"]
    assert [str(k) for k in first.host.yielded] == ["unit/0/0", "unit/0/1", "unit/0/2"]
    # 3 tensors per sample copied, packing inside the side stream, then the event
    assert ops.calls == ["side:enter", *["copy"] * 6, "record", "side:exit"]
    ops.calls.clear()
    pre.fill()  # sample 3, then the stream's idle yield ends the batch early
    assert pre.queued == 1 and ops.calls[-2:] == ["record", "side:exit"]
    ops.calls.clear()
    tensors = copier.ready(first)
    assert ops.calls == ["wait", *["hand_over"] * len(tensors)]  # wait for the event before any use
    # what was staged is exactly pack() of the float32-free features (the file's dtype, bf16)
    assert tensors["hidden_states"].dtype == torch.bfloat16
    packed = sum(int(s.token_ids.shape[0]) - 1 for s in (samples[0], samples[2]))
    # padded on the device to a length the compiled forward has seen (test_bucket_rows.py)
    assert tensors["input_ids"].shape[1] == bucket_length(packed) and int((tensors["document_ids"] >= 0).sum()) == packed
    ref = pad_to_bucket(pack([f for f in copier._features(first.host, None, None)]))
    for k, v in ref.items():
        assert torch.equal(v, tensors[k]), k
    second = pre.take()
    assert second is not None and second.host.keys == ["unit/0/3"] and not src.ended
    third = pre.take()
    assert third is not None and third.host.keys == ["unit/0/4"]
    assert pre.take() is None and pre.exhausted


@pytest.mark.parametrize("prefetch", [0, 1])
def test_idle_yields_let_the_loop_checkpoint_a_jobs_tail(tiny_model, samples, tmp_path, prefetch):  # noqa: F811
    """A stream that goes quiet (``None``) while the sidecar has nothing left: the loop asks
    ``drained`` and acknowledges what it holds instead of waiting for a sample that cannot come.
    Prefetching (CUDA's default: 1) takes the first quiet yield while the last step runs, so the
    acknowledgement comes one quiet yield later there, and no later."""

    class IdleStream(ListStream):
        idle_s = 0.01

        quiet = 0

        def __iter__(self):
            for s in self.samples:
                self.used.append(s.key)
                yield s
            for _ in range(3):  # quiet: the tail is held, nothing else will arrive
                self.quiet += 1
                yield None

    asked = []
    stream = IdleStream(samples[:5])
    acked_at = []
    stream.on_ack = lambda k: acked_at.append((str(k), stream.quiet))
    tr = Eagle3OnlineTrainer(cfg(tiny_model, tmp_path / "r", checkpoint_every=100, prefetch=prefetch),
                             counts_of(samples))  # fmt: skip
    tr.drained = lambda pending: asked.append(pending) or pending > 0 and len(asked) > 5
    res = tr.train(stream)
    assert [str(k) for k in stream.acked] == [str(s.key) for s in samples[:5]]
    assert acked_at == [("unit/0/4", 1 + prefetch)]  # at the first idle yield it takes, not when the stream ended
    assert res.steps == 5
    assert asked[:5] == [1, 2, 3, 4, 5]  # asked before each step with what would be pending after it
