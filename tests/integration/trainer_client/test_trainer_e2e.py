"""The trainer (Eagle-3, and the parallel drafts) and the dataset wrapper on the real stack (vLLM CPU build + sidecar + ZeroMQ).

One engine for the module, serving the tiny verifier with layers [2, 6, 9, 12]:

* negative control: the same training with each sample's aux hidden states taken from another
  sample ends with a step-0 top-1 at least 0.1 below the aligned run: fails if the hidden
  states stop mattering (or stop lining up with the tokens). The tiny verifier here is the
  random one on purpose: its next token cannot be guessed from the tokens alone, only from
  its states, so the control isolates the hidden-state path in a short run (with the briefly
  pre-trained verifier a one-layer draft reading tokens alone gets most tokens right too, and
  the gap needs far longer training to open);
* SIGKILL of ``hsstream train`` after a checkpoint, then resume: by sample ids, the resumed
  run neither trains again what the checkpoint holds nor skips what it does not;
* the trainer's clear error when the stream lacks a layer it needs;
* the IterableDataset with 0 and 2 DataLoader workers, and two gloo ranks: disjoint samples,
  all of the job, everyone stops;
* ``hsstream train --nproc 2`` (torchrun, two gloo ranks, each its own stream): disjoint
  samples, each trained and acknowledged once by the rank that got it, only after a checkpoint
  that holds it; one checkpoint writer; both ranks exit 0; nothing left in the spool;
* ``make demo`` again: bench/served_acceptance/acceptance.py's training step twice in the same workdir.
* ``hsstream train --draft dflash|peagle`` for a few steps from the stream, its final checkpoint
  served by vLLM's CPU build with the speculative config the run printed (and the command
  stopping at once, naming the draft, without a mask token).
* ``hsstream train --config FILE`` (speculators' layout, a flag overriding it) without
  ``--steps``: the cosine LR decays over the job's samples to its floor, and the run ends with
  ``OUT/final``, ``OUT/latest`` and the ``vllm serve`` line.

The pre-trained verifier and its repeat fraction: test_trainer_pretrain.py; the acceptance
measurement in vLLM: bench/served_acceptance/acceptance.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import SESSION_ENV, prestarted
from tests.integration.conftest import start_stack, stop_stack, submit, tiny
from trainer_client import HiddenStateStream
from trainer_client.dataset import HiddenStateDataset, make_loader
from trainer_client.eagle3 import Eagle3OnlineTrainer, TrainConfig
from trainer_client.train.run import drained_probe
from trainer_client.train.trainer import KEYS_LOG
from trainer_client.train.vocab import count_tokens

LAYERS = [2, 6, 9, 12]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def verifier(tiny_model) -> str:
    return tiny_model


def _start():
    # a killed trainer's leases come back quickly
    return start_stack(tiny(), LAYERS, prefix="hsstream-test-trainer-", env={"HSSTREAM_TRAINER_TIMEOUT_S": "10"},
                       base_env=SESSION_ENV)  # fmt: skip


PRESTART = {"stack": (_start, stop_stack)}  # tests/support/prestart.py


@pytest.fixture(scope="module")
def stack(verifier):
    st = prestarted(__name__, "stack")
    assert st.model == verifier
    # The sidecar's token where a user's shell has it: our clients in this process (the trainer's
    # drained probe) and the `hsstream train` commands the tests start find it there.
    before = os.environ.get("HSSTREAM_API_TOKEN")
    os.environ["HSSTREAM_API_TOKEN"] = st.token
    try:
        yield st
    finally:
        if before is None:
            os.environ.pop("HSSTREAM_API_TOKEN", None)
        else:
            os.environ["HSSTREAM_API_TOKEN"] = before
        stop_stack(st)


def windows(verifier: str, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` token windows of exactly ``length`` tokens cut from fresh corpus documents."""
    from transformers import AutoTokenizer

    from hsstream.pretrain_verifier import corpus_documents

    tok = AutoTokenizer.from_pretrained(verifier)
    ids: list[int] = []
    for d in corpus_documents(n * length // 40 + 20, seed):
        ids += tok(d, add_special_tokens=False)["input_ids"] + [tok.pad_token_id]
    assert len(ids) >= n * length
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def job_counts(stack, job) -> dict:
    return httpx.get(f"{stack.api}/v1/jobs/{job}", timeout=10, headers=stack.headers).json()["counts"]


def cfg(verifier, out, **kw) -> TrainConfig:
    base = dict(verifier=verifier, out_dir=str(out), draft_vocab_size=256, lr=3e-3, warmup_steps=10,
                checkpoint_every=1000, progress=False, tensorboard=False, threads=1)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def test_negative_control_swapped_hidden_states_learn_less(stack, verifier, tmp_path):
    n = 160
    wins = windows(verifier, n, 96, seed=4242)
    counts = count_tokens(wins)
    results = {}
    for control in ("none", "swap-hidden"):
        job = submit(stack, [{"token_ids": w} for w in wins])
        tr = Eagle3OnlineTrainer(cfg(verifier, tmp_path / control, control=control), counts)
        tr.drained = drained_probe(stack.api, [job], stack.token)
        with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, ack="manual",
                               timeout_s=300) as s:  # fmt: skip
            results[control] = tr.train(s)
        assert job_counts(stack, job)["consumed"] == n
    aligned, swapped = results["none"], results["swap-hidden"]
    print(f"step-0 top-1 over the last {aligned.window} steps: aligned {aligned.top1[0]:.3f}, "
          f"swapped {swapped.top1[0]:.3f}")  # fmt: skip
    assert aligned.samples == n and swapped.samples == n - 1  # the first swapped sample only donates
    assert aligned.top1[0] >= swapped.top1[0] + 0.1
    assert aligned.top1[0] > 0.2  # and the aligned draft really learned


def _keys_by_pid(out: Path) -> dict[int, list[tuple[int, str]]]:
    res: dict[int, list[tuple[int, str]]] = {}
    if not (out / KEYS_LOG).exists():
        return res
    for line in (out / KEYS_LOG).read_text().splitlines():
        if line.endswith("}"):
            r = json.loads(line)
            res.setdefault(r["pid"], []).extend((r["step"], k) for k in r["keys"])
    return res


def _train_cmd(stack, verifier, out, job) -> list[str]:
    return [
        sys.executable, "-m", "hsstream", "train", "--model", verifier, "--out", str(out), "--job", job,
        "--api", stack.api, "--endpoint", stack.delivery_endpoint, "--spool", str(stack.spool),
        "--draft-vocab-size", "256", "--checkpoint-every", "8", "--no-progress", "--timeout", "120",
    ]  # fmt: skip


def test_sigkill_after_checkpoint_then_resume_trains_each_sample_once(stack, verifier, tmp_path):
    from trainer_client.train.checkpoints import latest_checkpoint, load_state

    n = 40
    wins = windows(verifier, n, 48, seed=777)
    job = submit(stack, [{"token_ids": w} for w in wins])
    out = tmp_path / "run"
    cmd = _train_cmd(stack, verifier, out, job)
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        def past_a_checkpoint() -> bool:
            ck = latest_checkpoint(out)
            steps = [s for rows in _keys_by_pid(out).values() for s, _ in rows]
            return ck is not None and bool(steps) and max(steps) > load_state(ck)["step"]

        while True:  # kill once a checkpoint exists and training went on past it
            if past_a_checkpoint():
                # Stopped, then looked at again: a checkpoint written between the look and the
                # kill would leave nothing trained past it (the state judged is the one killed).
                os.killpg(first.pid, signal.SIGSTOP)
                if past_a_checkpoint():
                    break
                os.killpg(first.pid, signal.SIGCONT)
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.01)
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    ck = latest_checkpoint(out)
    ck_step = load_state(ck)["step"]
    (pid1, rows1), = _keys_by_pid(out).items()
    in_ckpt = {k for s, k in rows1 if s <= ck_step}
    lost = {k for s, k in rows1 if s > ck_step}  # trained after the checkpoint: rolled back by the kill
    assert in_ckpt and lost and len(in_ckpt) == ck_step

    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout[second.stdout.index("{") :])
    rows2 = [r for pid, r in _keys_by_pid(out).items() if pid != pid1]
    assert len(rows2) == 1
    resumed = [k for _, k in rows2[0]]
    every = {f"{job}/0/{i}" for i in range(n)}
    assert len(resumed) == len(set(resumed))  # nothing twice within the resumed run
    assert not in_ckpt & set(resumed)  # nothing the checkpoint holds is trained again
    assert lost <= set(resumed)  # what the kill rolled back is trained again
    assert in_ckpt | set(resumed) == every  # nothing skipped
    assert min(s for s, _ in rows2[0]) == ck_step + 1 and summary["steps"] == n
    counts = job_counts(stack, job)
    assert counts["consumed"] == n and counts["leased"] == 0
    assert stack.spool_files() == []


def test_demo_training_step_runs_again_in_the_same_workdir(stack, verifier, tmp_path):
    """``make demo`` twice in one clone (issue 21): bench/served_acceptance/acceptance.py's training step, on a new
    job each time (a new stack, as each run has) and the same ``--workdir``, succeeds both times.
    The second used to be refused (exit 2): "WORKDIR/draft-run belongs to a run following jobs
    [the first run's], not [its own]"."""
    from bench.served_acceptance.acceptance import RUN_DIR_NAME, train_draft

    n = 6
    for run in range(2):
        job = submit(stack, [{"token_ids": w} for w in windows(verifier, n, 32, seed=900 + run)])
        _, p, _ = train_draft(verifier, stack, [job], tmp_path, draft_vocab_size=256, steps=n, lr=3e-3, seed=0,
                              checkpoint_every=n)  # fmt: skip
        if p.returncode != 0:
            httpx.delete(f"{stack.api}/v1/jobs/{job}", timeout=30, headers=stack.headers)  # its samples stay unacknowledged
        assert p.returncode == 0, f"run {run + 1}: {p.stderr[-3000:]}"
        summary = json.loads(p.stdout[p.stdout.index("{") :])
        assert summary["steps"] == n and summary["samples"] == n
        assert json.loads((tmp_path / RUN_DIR_NAME / "jobs.json").read_text())["jobs"] == [job]
        assert Path(summary["draft_dir"]).is_relative_to(tmp_path / RUN_DIR_NAME)
        assert job_counts(stack, job)["consumed"] == n
    assert stack.spool_files() == []


def test_trainer_names_the_missing_layer(stack, verifier, tmp_path):
    job = submit(stack, [{"token_ids": windows(verifier, 1, 32, seed=5)[0]}])
    cmd = _train_cmd(stack, verifier, tmp_path / "run", job) + ["--aux-layers", "1,6,9"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "not aux layer(s) [1]" in p.stderr and "[2, 6, 9, 12]" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    httpx.delete(f"{stack.api}/v1/jobs/{job}", timeout=30, headers=stack.headers).raise_for_status()  # its sample was never acknowledged


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_with_dataloader_workers_gets_the_job_once(stack, verifier, workers):
    n = 12
    job = submit(stack, [{"token_ids": w} for w in windows(verifier, n, 24, seed=11 + workers)])
    ds = HiddenStateDataset(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120,
                            transform=lambda s: (str(s.key), s.token_ids.shape[0], tuple(s.layer_ids)))  # fmt: skip
    loader = make_loader(ds, batch_size=4, num_workers=workers)
    got = [x for batch in loader for x in batch]
    assert sorted(k for k, _, _ in got) == sorted(f"{job}/0/{i}" for i in range(n))
    assert {(t, lids) for _, t, lids in got} == {(24, tuple(LAYERS))}
    assert job_counts(stack, job)["consumed"] == n


_RANK = textwrap.dedent(
    """
    import json, sys, time
    import torch.distributed as dist
    from trainer_client.dataset import HiddenStateDataset, stop_together
    endpoint, spool, job = sys.argv[1:4]
    dist.init_process_group("gloo")
    ds = HiddenStateDataset(endpoint, jobs=[job], spool_dir=spool, credit=1, timeout_s=120)
    keys, steps = [], 0
    for smp in stop_together(ds):
        steps += 1
        if smp is not None:
            keys.append(str(smp.key))
            time.sleep(0.05)  # a training step
    dist.barrier()
    print(json.dumps({"rank": dist.get_rank(), "keys": keys, "steps": steps}))
    dist.destroy_process_group()
    """
)


def test_two_gloo_ranks_get_disjoint_samples_and_stop_together(stack, verifier):
    import socket

    n = 16
    job = submit(stack, [{"token_ids": w} for w in windows(verifier, n, 24, seed=99)])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   PYTHONPATH=str(ROOT))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK, stack.delivery_endpoint, str(stack.spool), job],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    res = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    a, b = (set(r["keys"]) for r in res)
    assert a and b and not a & b
    assert a | b == {f"{job}/0/{i}" for i in range(n)}
    assert res[0]["steps"] == res[1]["steps"] >= max(len(a), len(b))  # None steps while a rank waits
    assert job_counts(stack, job)["consumed"] == n


def test_hsstream_train_nproc_2_gloo_ranks_disjoint_one_writer_acks_once_stop_together(stack, verifier, tmp_path):
    """``hsstream train --nproc 2``: torchrun, two gloo ranks, each with its own stream."""
    from trainer_client.train.checkpointing import CKPT_LOG

    n = 24
    job = submit(stack, [{"token_ids": w} for w in windows(verifier, n, 40, seed=2024)])
    out = tmp_path / "ddp"
    cmd = _train_cmd(stack, verifier, out, job) + ["--nproc", "2", "--device", "cpu"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]  # torchrun: 0 only if both ranks exited 0
    summary = json.loads(p.stdout[p.stdout.index("{") :])
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    pids = {r["rank"]: r["pid"] for r in summary["ranks"]}
    trained: dict[int, list[str]] = {0: [], 1: []}
    step_of: dict[str, int] = {}
    for line in (out / KEYS_LOG).read_text().splitlines():
        r = json.loads(line)
        assert r["pid"] == pids[r["rank"]]
        trained[r["rank"]] += r["keys"]
        step_of.update((k, r["step"]) for k in r["keys"])
    every = {f"{job}/0/{i}" for i in range(n)}
    a, b = trained[0], trained[1]
    assert a and b and not set(a) & set(b)  # disjoint samples, both ranks trained
    assert len(a) + len(b) == n and set(a) | set(b) == every  # each sample trained once, none missing
    assert summary["samples"] == n and [r["samples"] for r in summary["ranks"]] == [len(a), len(b)]
    log = [json.loads(x) for x in (out / CKPT_LOG).read_text().splitlines()]
    saves = [r for r in log if r["event"] == "save"]
    assert saves and {(r["rank"], r["pid"]) for r in saves} == {(0, pids[0])}  # exactly one checkpoint writer
    saved_steps: set[int] = set()
    acked: dict[int, list[str]] = {0: [], 1: []}
    for r in log:  # in file order: a rank acks only what a checkpoint already on disk holds
        if r["event"] == "save":
            saved_steps.add(r["step"])
        else:
            assert r["step"] in saved_steps and r["pid"] == pids[r["rank"]]
            assert all(step_of[k] <= r["step"] for k in r["keys"])
            acked[r["rank"]] += r["keys"]
    assert sorted(acked[0]) == sorted(a) and sorted(acked[1]) == sorted(b)  # each rank acks its own, once
    last = max(saved_steps)
    assert last == summary["steps"] and {r["rank"] for r in log if r["event"] == "ack" and r["step"] == last} <= {0, 1}
    counts = job_counts(stack, job)
    assert counts["consumed"] == n and counts["leased"] == 0 and counts["ready"] == 0
    assert stack.spool_files() == []


def test_hsstream_train_from_a_config_file_decays_over_the_job_and_ends_with_a_draft_to_serve(stack, verifier, tmp_path):
    import shlex

    import yaml

    from trainer_client.train import checkpoints as M

    n = 16
    job = submit(stack, [{"token_ids": w} for w in windows(verifier, n, 32, seed=4242)])
    out = tmp_path / "cfg-run"
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump({"train": {
        "verifier": {"verifier_name_or_path": verifier}, "trainer": {"save_path": str(out), "log_freq": 1},
        "optimizer": {"lr": 0.5}, "jobs": [job], "api": stack.api, "endpoint": stack.delivery_endpoint,
        "spool": str(stack.spool), "draft_vocab_size": 256, "warmup_steps": 2, "checkpoint_every": 4,
        "keep_checkpoints": 1, "progress": False, "timeout": 120, "logger": "none",
    }}))  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "hsstream", "train", "--config", str(conf), "--lr", "0.002"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout[p.stdout.index("{") :])
    assert summary["steps"] == n
    assert json.loads((out / "jobs.json").read_text())["samples_total"] == n
    lrs = [json.loads(x)["lr"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(lrs) == pytest.approx(0.002)  # the flag, not the file's 0.5
    assert lrs[-1] == pytest.approx(0.1 * 0.002, rel=0.05)  # at the floor when the job ends: not constant
    final = out / M.FINAL_DIR
    assert summary["final_dir"] == str(final) and (final / "config.json").is_file()
    assert (out / M.LATEST_LINK).resolve() == (M.latest_checkpoint(out) / M.DRAFT_DIR).resolve()
    line = p.stderr.strip().splitlines()[-1].strip()
    assert line == summary["serve"] and shlex.split(line)[:3] == ["vllm", "serve", verifier]
    assert json.loads(shlex.split(line)[4])["model"] == str(final.resolve())
    assert job_counts(stack, job)["consumed"] == n
    assert stack.spool_files() == []


@pytest.mark.parametrize("draft", ["dflash", "peagle"])
def test_each_parallel_draft_trains_from_the_stream_and_its_checkpoint_serves_in_vllm(stack, verifier, tmp_path, draft):
    """``hsstream train --draft X`` from the real stream for a few steps; vLLM's CPU build then
    loads the final checkpoint with the speculative config the run printed and drafts with it.
    Without a mask token the same command stops at once (exit 2), naming the draft."""
    from hsstream.evaluate import run_serving

    out = tmp_path / draft
    base = [sys.executable, "-m", "hsstream", "train", "--model", verifier, "--draft", draft, "--out", str(out / "x"),
            "--job", "none", "--no-progress"]  # fmt: skip
    p = subprocess.run(base, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    label = {"dflash": "DFlash", "peagle": "P-EAGLE"}[draft]
    assert p.returncode == 2 and f"{label} needs a mask token" in p.stderr and "--mask-token-id" in p.stderr, p.stderr[-2000:]
    n = 16
    job = submit(stack, [{"token_ids": w} for w in windows(verifier, n, 48, seed=77)])
    cmd = [*_train_cmd(stack, verifier, out, job), "--draft", draft, "--mask-token-id", "1", "--steps", str(n)]
    p = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout[p.stdout.index("{") :])
    assert res["draft"] == draft and res["steps"] == n and res["samples"] == n
    spec = res["speculative_config"]
    assert spec["model"] == str((out / "final").resolve()) and json.dumps(spec) in res["serve"].replace("'", "")
    conf = json.loads((out / "final" / "config.json").read_text())
    assert conf["speculators_model_type"] == draft and conf["mask_token_id"] == 1
    served = run_serving(verifier, spec["model"], ["Alice lives in the", "1, 2, 3,"], 8, [0.0], tmp_path, f"serve-{draft}",
                         spec_tokens=spec["num_speculative_tokens"], per_request=True, spec=spec)  # fmt: skip
    v = served["0.0"]
    assert v["generated_tokens"] == 16 and v["vllm_metrics"]["drafts"] > 0, v
    assert len(v["vllm_metrics"]["acceptance_per_position"]) == spec["num_speculative_tokens"]


def test_dspark_trains_from_the_stream_and_eval_says_it_needs_a_gpu(stack, verifier, tmp_path):
    """``hsstream train --draft dspark`` from the real stream; vLLM's CPU build cannot serve DSpark
    (its V1 model runner refuses it), so ``hsstream eval`` on the checkpoint stops with exit 2,
    naming the GPU it needs and vLLM's refusal, before any engine starts."""
    n = 8
    out = tmp_path / "dspark"
    job = submit(stack, [{"token_ids": w} for w in windows(verifier, n, 48, seed=78)])
    cmd = [*_train_cmd(stack, verifier, out, job), "--draft", "dspark", "--mask-token-id", "1", "--steps", str(n),
           "--markov-rank", "32"]  # fmt: skip
    p = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout[p.stdout.index("{") :])
    assert res["draft"] == "dspark" and res["steps"] == n and res["samples"] == n and len(res["top1"]) == 4
    final = out / "final"
    assert res["speculative_config"] == {"method": "dspark", "model": str(final.resolve()), "num_speculative_tokens": 4}
    conf = json.loads((final / "config.json").read_text())
    assert (conf["speculators_model_type"], conf["markov_rank"], conf["aux_hidden_state_layer_ids"]) == ("dspark", 32, LAYERS[:3])
    assert job_counts(stack, job)["consumed"] == n
    e = subprocess.run([sys.executable, "-m", "hsstream", "eval", "--draft", str(final), "--model", verifier],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert e.returncode == 2 and "a dspark draft needs a GPU" in e.stderr, e.stderr[-2000:]
    assert "Model Runner V1 does not support: dspark speculative decoding" in e.stderr and "Traceback" not in e.stderr
