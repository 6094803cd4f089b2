"""Real vLLM (CPU build, bf16) → connector → /dev/shm → sidecar → HiddenStateStream, checked
against HF transformers in float32 on the same checkpoint.

One engine: layers [1, 2, N-1, N] with prefix caching on (so the same engine also proves a
cache hit still yields full-length, correct states).
"""

from __future__ import annotations

import random
import re

import torch

from hsstream.tiny_model import hf_hidden_states
from tests.conftest import CPU_BUILD_EXECUTOR, SESSION_ENV
from tests.integration.conftest import stack_fixture, start_stack, stop_stack, submit, tiny
from trainer_client import HiddenStateStream

N = 12
LAYERS = [1, 2, N - 1, N]


def _start():
    # The CPU build's default topology (worker and engine core in two processes): the connector's
    # two halves proven against HF across that split; the other modules run the one-process worker.
    return start_stack(tiny(), LAYERS, prefix_caching=True, env=CPU_BUILD_EXECUTOR, base_env=SESSION_ENV)


PRESTART = {"stack": (_start, stop_stack)}  # tests/support/prestart.py
stack = stack_fixture(__name__)


def consume(stack, job):
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
        out = list(s)
        return out, dict(s.stats)


def assert_close_to_hf(model, sample, layers):
    ref = hf_hidden_states(model, sample.token_ids.tolist(), layers)
    got = sample.hidden_states.float()
    assert got.shape == ref.shape
    for j, lid in enumerate(layers):
        scale = ref[:, j].abs().max().item()
        err = (got[:, j] - ref[:, j]).abs().max().item()
        assert err <= 0.05 * scale, f"layer {lid}: max abs err {err:.4g} > 5% of {scale:.4g}"


def test_streamed_states_match_hf(stack, tiny_model):
    rng = random.Random(1)
    samples = [{"token_ids": [rng.randrange(0, 509) for _ in range(n)], "id": f"s{n}"} for n in (1, 7, 16, 17, 63, 200)]
    samples.append({"prompt": "Streaming hidden states: ünïcödé ✓ and code `x = 1`", "id": "text"})
    job = submit(stack, samples)
    got, stats = consume(stack, job)
    assert len(got) == len(samples) and stats["invalid"] == 0
    # the connector's default checksum (sample_file.CONNECTOR_CHECKSUM_ALGO), verified by the stream
    assert {s.notice.checksum_algo for s in got} == {"xxh3-128"}
    by_label = {s.label: s for s in got}
    for smp in samples[:-1]:
        s = by_label[smp["id"]]
        assert s.token_ids.tolist() == smp["token_ids"]
        assert s.layer_ids == LAYERS and s.hidden_states.dtype == torch.bfloat16
        assert_close_to_hf(tiny_model, s, LAYERS)
    assert_close_to_hf(tiny_model, by_label["text"], LAYERS)
    assert stack.spool_files() == []


def prefix_cache_hits(stack) -> float:
    import httpx

    m = httpx.get(f"http://127.0.0.1:{stack.vllm_port}/metrics", timeout=10).text
    hits = [ln for ln in m.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
    assert hits, "vLLM exposes no prefix-cache counter"
    return float(hits[0].split()[-1])


def test_prefix_cache_hit_gives_full_length(stack, tiny_model):
    rng = random.Random(2)
    prefix = [rng.randrange(0, 509) for _ in range(300)]  # > 2 blocks, whatever the block size
    a = prefix + [rng.randrange(0, 509) for _ in range(9)]
    b = prefix + [rng.randrange(0, 509) for _ in range(23)]
    got_a, _ = consume(stack, submit(stack, [{"token_ids": a}]))
    hits_before = prefix_cache_hits(stack)
    got_b, _ = consume(stack, submit(stack, [{"token_ids": b}]))  # submitted after a finished
    # the second request really was served partly from the cache
    assert prefix_cache_hits(stack) - hits_before >= 16
    for ids, got in ((a, got_a), (b, got_b)):
        assert len(got) == 1
        s = got[0]
        assert s.token_ids.tolist() == ids and s.hidden_states.shape[0] == len(ids)
        assert_close_to_hf(tiny_model, s, LAYERS)
    assert stack.spool_files() == []


#: A log line of vLLM's model worker when it runs in a process of its own (the mp executor).
WORKER_PROCESS = re.compile(r"^\((?:VllmWorker-\d+|Worker) pid=\d+\)", re.M)


def test_this_module_runs_the_worker_in_its_own_process(stack):
    """CPU_BUILD_EXECUTOR reaches vLLM: its log has lines of a worker process (which the one-process
    topology of the other modules has not: test_layer_order checks that side)."""
    assert WORKER_PROCESS.search((stack.workdir / "vllm.log").read_text())
