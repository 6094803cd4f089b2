"""Limits the sidecar only learns from running things, on a real stack.

One engine (vLLM CPU build, ``--max-model-len 512``) and a sidecar that cannot read the
verifier's config: ``HSSTREAM_MODEL`` is a hub-like id (offline, so no config and no
tokenizer) and ``HSSTREAM_LAYER_IDS`` is unset, while vLLM runs the tiny verifier with the
launcher's default layers. The tests run in file order: the engine's first request is a
1-token prompt (the case that dies with SIGILL on AMX CPUs without the permission), and the
sidecar's first job is the one that must teach it the sample size.
"""

from __future__ import annotations

import os
import re
import time

import httpx
import torch

from connector import protocol as P
from connector.layers import default_layer_ids
from hsstream import amx
from tests.conftest import CPU_BUILD_EXECUTOR, SESSION_ENV
from tests.integration.conftest import stack_fixture, start_stack, stop_stack, tiny
from trainer_client import HiddenStateStream

N_LAYERS = 12
LAYERS = default_layer_ids(N_LAYERS)  # what the launcher passes when no layer ids are given
PER_POSITION = len(LAYERS) * 128 * 2  # tiny verifier: hidden 128, bf16
SAMPLE_TOKENS = 100
FILE_BYTES = P.expected_file_bytes(SAMPLE_TOKENS, len(LAYERS), 128, 2)
BUDGET = 3 * FILE_BYTES + 1000  # three samples of the learned size fit, a fourth does not


def _start():
    return start_stack(tiny(), LAYERS, prefix="hsstream-limits-", max_model_len=512, base_env=SESSION_ENV, env={
        "HSSTREAM_MODEL": "hsstream-tests/no-such-model",  # the sidecar's view only; vLLM gets --model
        "HSSTREAM_LAYER_IDS": "",
        "HSSTREAM_SPOOL_BUDGET_BYTES": str(BUDGET),
        **CPU_BUILD_EXECUTOR,  # AMX is asked for in each of the CPU build's three vLLM processes
    })  # fmt: skip


PRESTART = {"stack": (_start, stop_stack)}  # tests/support/prestart.py
stack = stack_fixture(__name__)


def vllm_child(stack):
    return next(c for c in stack.children if c.name == "vllm")


def process_group(pgid: int) -> dict[int, str]:
    """pid -> command line of every process in a process group (vLLM's API server, engine, workers)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    out[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    return out


def hf_next_token_scores(model_dir: str, candidates: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return m(torch.tensor(candidates).unsqueeze(1)).logits[:, -1].float()


def test_first_request_of_one_token_is_answered_and_each_vllm_process_reported_amx(stack, tiny_model):
    # A prompt token whose greedy answer is clear in float32, so bf16 vLLM must give the same.
    candidates = list(range(3, 200))
    logits = hf_next_token_scores(tiny_model, candidates)
    top2 = logits.topk(2, dim=-1)
    gap = (top2.values[:, 0] - top2.values[:, 1]) / logits.std(dim=-1)
    i = int(gap.argmax())
    prompt, want = candidates[i], int(top2.indices[i, 0])
    assert gap[i] > 0.5, "no prompt token with a clear greedy answer in the tiny verifier"
    r = httpx.post(f"http://127.0.0.1:{stack.vllm_port}/v1/completions", timeout=120, json={
        "model": "verifier", "prompt": [prompt], "max_tokens": 1, "temperature": 0, "return_token_ids": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [want]
    name = (r.json().get("kv_transfer_params") or {}).get("hsstream_file")
    deadline = time.time() + 30  # our connector wrote this plain request's states too: remove them
    while not P.remove_from_spool(stack.spool, name) and time.time() < deadline:
        time.sleep(0.2)
    child = vllm_child(stack)
    assert child.alive(), child.tail()
    procs = {pid: cmd for pid, cmd in process_group(child.proc.pid).items() if "resource_tracker" not in cmd}
    assert len(procs) >= 3, procs  # API server, engine core, worker
    lines = re.findall(rf"{amx.LOG_PREFIX} ([a-z ]+): (.*) \(pid (\d+)\)", child.log_path.read_text(errors="replace"))
    reported = {int(pid): (outcome, detail) for outcome, detail, pid in lines}
    assert set(procs) <= set(reported), f"vLLM processes without an AMX line: {set(procs) - set(reported)}"
    if amx.has_amx(amx.cpu_flags()):
        assert all(reported[p][0] == "requested" for p in procs), reported
    else:
        assert all(reported[p] == ("not needed", "this CPU has no AMX") for p in procs), reported


def test_sample_longer_than_the_engine_limit_is_422_naming_it(stack):
    stats = httpx.get(f"{stack.api}/v1/stats", timeout=10, headers=stack.headers).json()
    assert stats["engine_max_model_len"] == 512
    r = httpx.post(f"{stack.api}/v1/jobs", timeout=60, headers=stack.headers, json={"samples": [{"token_ids": [5] * 1890, "id": "long"}]})
    assert r.status_code == 422, r.text
    reason = r.json()["detail"]["samples"][0]["reason"]
    assert reason == "sample has 1890 tokens, more than vLLM's max_model_len of 512 allows (511 prompt tokens + 1 generated)"


def test_unknown_sample_size_one_in_flight_until_the_first_notice_then_by_the_learned_size(stack):
    st = lambda: httpx.get(f"{stack.api}/v1/stats", timeout=10, headers=stack.headers).json()  # noqa: E731
    assert st()["sample_size"] == {"known": False, "source": None}  # no config, and no notice of ours yet
    n = 10
    samples = [{"token_ids": [(7 * i + j) % 500 + 3 for j in range(SAMPLE_TOKENS)], "id": f"s{i}"} for i in range(n)]
    r = httpx.post(f"{stack.api}/v1/jobs", json={"samples": samples}, timeout=60, headers=stack.headers)
    assert r.status_code == 200, r.text
    job = r.json()["job_id"]
    # No trainer yet: submission stops where the learned size says the budget is full.
    t0, last, since = time.time(), None, time.time()
    while time.time() - t0 < 120:
        now = st()
        key = (now["states"], now["reserved_bytes"])
        if key != last:
            last, since = key, time.time()
        elif (time.time() - since > 3 and now["states"].get("submitted", 0) == 0 and now["sample_size"]["known"]
              and now["states"].get("ready", 0) >= 1):  # settled after production, not before it began
            break
        time.sleep(0.2)
    stats = st()
    assert stats["sample_size"]["known"] and stats["sample_size"]["source"] == "notice"
    assert stats["sample_size"]["bytes_per_position"] == PER_POSITION
    assert stats["submitter"]["submitted_before_size_known"] == 1
    assert stats["submitter"]["max_in_flight_before_size_known"] == 1
    assert stats["states"] == {"ready": 3, "queued": n - 3}, stats  # by the learned size: 3 fit the budget
    assert stats["reserved_bytes"] <= BUDGET
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
        got = list(s)
    assert sorted(x.label for x in got) == sorted(x["id"] for x in samples)
    assert all(x.hidden_states.shape == (SAMPLE_TOKENS, len(LAYERS), 128) for x in got)
    assert stack.spool_files() == []
