"""The connector alone, as a drop-in for vLLM's Example connector: real vLLM (CPU build) with our
connector and no sidecar (``notice_endpoint: none``), clients talking straight to vLLM's
OpenAI server and reading files the way clients of the Example connector do:

* vLLM 0.32's own ``load_hidden_states`` (waits on ``<path>.lock``) right after each response;
* speculators 0.9's online data path (its ``ArrowDataset`` + DataLoader with hs-connectors'
  ``FileTransfer``), unchanged, generating every sample through us.

One engine for the module: layers configured as [N, 2, 6, 9] with ``layer_order: sorted``
(the Example connector's order, which speculators needs: it takes the last column as the
verifier's final state), checked against HF transformers.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from hsstream import launch
from hsstream.devstack import free_port
from hsstream.tiny_model import hf_hidden_states
from tests.conftest import SESSION_ENV, prestarted
from tests.integration.conftest import tiny

N = 12
CONFIG_LAYERS = [N, 2, 6, 9]
FILE_LAYERS = sorted(CONFIG_LAYERS)
MODEL_NAME = "verifier"


class PlainVllm:
    def __init__(self, model: str, layer_ids: list[int] = CONFIG_LAYERS, layer_order: str = "sorted",
                 base_env: dict | None = None) -> None:  # fmt: skip
        self.model = model
        self.spool = Path(tempfile.mkdtemp(prefix="hsstream-dropin-", dir="/dev/shm"))
        self.workdir = Path(tempfile.mkdtemp(prefix="hsstream-dropin-log-"))
        self.port = free_port()
        opts = launch.VllmOptions(
            model=model, layer_ids=layer_ids, spool_dir=str(self.spool), notice_endpoint="none",
            port=self.port, max_model_len=1024, gpu_memory_utilization=0.2 if launch.is_cpu_build() else None,
            enforce_eager=True, layer_order=layer_order, served_model_name=MODEL_NAME,
        )  # fmt: skip
        self.child = launch.spawn("vllm", launch.vllm_args(opts), launch.child_env(base=base_env), self.workdir / "vllm.log")
        try:
            launch.wait_http(f"{self.url}/v1/models", self.child, timeout=600)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, prompt, **body) -> dict:
        r = httpx.post(f"{self.url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        vals = [float(ln.split()[-1]) for ln in text.splitlines() if re.match(rf"^{name}(\{{|\s)", ln)]
        assert vals, f"vLLM exposes no {name}"
        return sum(vals)

    def spool_files(self) -> list[str]:
        return sorted(os.listdir(self.spool))

    def log(self) -> str:
        return (self.workdir / "vllm.log").read_text(errors="replace")

    def stop(self) -> None:
        self.child.stop()
        shutil.rmtree(self.spool, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)


PRESTART = {"vllm": (lambda: PlainVllm(tiny(), base_env=SESSION_ENV), PlainVllm.stop)}  # tests/support/prestart.py


@pytest.fixture(scope="module")
def vllm():
    v = prestarted(__name__, "vllm")
    yield v
    v.stop()


def assert_matches_hf(model: str, token_ids: list[int], hs: torch.Tensor, layers: list[int], ref_dtype: str = "float32") -> None:
    """bf16 vLLM vs HF (float32 unless ``ref_dtype`` says otherwise): each layer within 5% of its
    max abs, and the layers distinct."""
    ref = hf_hidden_states(model, token_ids, layers, dtype=ref_dtype)
    got = hs.float()
    assert tuple(got.shape) == tuple(ref.shape), (tuple(got.shape), tuple(ref.shape))
    for j, lid in enumerate(layers):
        scale = ref[:, j].abs().max().item()
        err = (got[:, j] - ref[:, j]).abs().max().item()
        assert err <= 0.05 * scale, f"layer {lid}: max abs err {err:.4g} > 5% of {scale:.4g}"
    for j in range(1, len(layers)):
        assert (got[:, j] - got[:, j - 1]).abs().max().item() > 0.05 * got[:, j].abs().max().item()


def _wait_idle(v: PlainVllm, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while v.metric("vllm:num_requests_running") + v.metric("vllm:num_requests_waiting") > 0:
        assert time.monotonic() - t0 < timeout, "vLLM still busy"
        time.sleep(0.2)


def test_every_file_read_through_the_lock_protocol_right_after_its_response(vllm, tiny_model):
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    rng = random.Random(3)
    prompts = [[rng.randrange(0, 509) for _ in range(rng.choice((2, 5, 16, 17, 40, 150, 400)))] for _ in range(24)]
    missing: list[str] = []
    read: dict[int, dict] = {}

    def one(i: int) -> None:
        out = vllm.complete(prompts[i])
        path = out["kv_transfer_params"]["hidden_states_path"]
        try:
            read[i] = load_hidden_states(path)  # immediately: the file is usually still being written
        except FileNotFoundError:
            missing.append(path)
        finally:
            cleanup_hidden_states(path)

    with ThreadPoolExecutor(6) as pool:  # several in flight, as a data-generation client runs
        list(pool.map(one, range(len(prompts))))
    assert missing == [] and len(read) == len(prompts)
    for i, t in read.items():
        assert t["token_ids"].tolist() == prompts[i]
        assert tuple(t["hidden_states"].shape) == (len(prompts[i]), len(FILE_LAYERS), 128)
    for i in (0, 5, 11):  # layer_order "sorted": ascending, as the Example connector writes
        assert_matches_hf(tiny_model, prompts[i], read[i]["hidden_states"], FILE_LAYERS)
    assert vllm.spool_files() == []  # 0 left behind: no file, no lock, no temp file


def test_refused_custom_path_and_aborted_request_leave_nothing(vllm, tmp_path):
    want = tmp_path / "mine.safetensors"
    out = vllm.complete([5, 6, 7, 8], kv_transfer_params={"hidden_states_path": str(want)})
    err = out["kv_transfer_params"]["hidden_states_error"]
    assert "allow_custom_save_path is off" in err and "hidden_states_path" not in out["kv_transfer_params"]
    # a client that gives up mid-generation: vLLM aborts the request, its path never reaches anyone
    # (900 tokens take ~1 s here: a 1 s timeout once saw the reply come first, so 0.3 s)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{vllm.url}/v1/completions", timeout=0.3, json={
            "model": MODEL_NAME, "prompt": list(range(10, 60)), "max_tokens": 900, "ignore_eos": True})  # fmt: skip
    _wait_idle(vllm)
    t0 = time.monotonic()  # the abort's error path runs on an engine step: waited for, not slept on
    while vllm.spool_files() and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    assert not want.exists() and vllm.spool_files() == []
    assert "allow_custom_save_path is off" in vllm.log()  # the error is in vLLM's log too


def test_speculators_online_data_path_reads_every_sample_once(vllm, tiny_model, tmp_path):
    """speculators' own dataset + DataLoader + hs-connectors FileTransfer, generating through vLLM."""
    from datasets import Dataset
    from speculators.train.dataloader import create_train_val_loaders

    rng = random.Random(4)
    rows = [[rng.randrange(0, 509) for _ in range(rng.randrange(3, 120))] for _ in range(16)]
    data = Dataset.from_dict({
        "input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "seq_len": [len(r) for r in rows]})  # fmt: skip
    data.set_format(type="torch")
    data.save_to_disk(str(tmp_path / "data"))
    before = vllm.metric("vllm:request_success_total")
    train, val = create_train_val_loaders(
        data_path=str(tmp_path / "data"), total_seq_len=4096, hidden_states_dtype=torch.bfloat16,
        vllm_endpoint=f"{vllm.url}/v1", on_missing="generate", verifier_name_or_path=MODEL_NAME,
        request_timeout=120, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=128, num_target_layers=3, num_workers=0, prefetch_factor=1, preprocess=None,
        train_data_ratio=0.75,
    )  # fmt: skip
    seen: list[tuple[int, ...]] = []
    for loader in (train, val):
        for batch in loader:
            assert batch["error_records"] == 0
            off = 0
            docs = batch["document_ids"][0]
            for n in torch.bincount(docs[docs >= 0]).tolist():  # speculators' packing: one id per sample
                ids = batch["input_ids"][0, off : off + n]
                seen.append(tuple(ids.tolist()))
                if len(seen) <= 3:  # the columns speculators takes are the layers it means
                    aux = batch["hidden_states"][0, off : off + n].reshape(n, 3, 128)
                    last = batch["verifier_last_hidden_states"][0, off : off + n].unsqueeze(1)
                    assert_matches_hf(tiny_model, ids.tolist(), torch.cat([aux, last], 1), FILE_LAYERS)
                off += n
    assert sorted(seen) == sorted(tuple(r) for r in rows)  # every sample, once
    assert vllm.metric("vllm:request_success_total") - before == len(rows)  # none generated twice
    assert vllm.spool_files() == []  # their cleanup found every file (and removed its lock)
    assert not (tmp_path / "data" / "hidden_states").exists() or not os.listdir(tmp_path / "data" / "hidden_states")
