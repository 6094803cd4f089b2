"""``hsstream eval`` on the real vLLM CPU build: our acceptance figures against vLLM's own counters.

The draft is trained briefly in-process on the pre-trained tiny verifier's hidden states from
plain HF (hsstream/tiny_model.py ``hf_hidden_states``, which the connector's output is checked
against in test_e2e_hidden_states.py), so that it accepts a fair share of tokens without the
stack's engine start; then one engine serves it (``--no-baseline``: the speed comparison needs
a second engine and is not what is checked here).

* our figures, from each request's per-step record (``CompletionOutput.spec_decode_metrics``),
  equal those from vLLM's ``vllm:spec_decode_*`` counters within 0.02: acceptance rate, per
  position, mean acceptance length;
* a directory that is not a draft is refused at once, with a message naming what is missing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

LAYERS = [2, 6, 9, 12]
ROOT = Path(__file__).resolve().parents[3]


def train_draft_from_hf(verifier: str, out: Path, *, samples: int, steps: int, seed: int = 0) -> Path:
    """A draft trained for ``steps`` steps on corpus documents' HF hidden states; its final/ dir."""
    import torch
    from transformers import AutoTokenizer

    from connector import protocol as P
    from hsstream.pretrain_verifier import SEED_DRAFT_TRAIN, corpus_documents
    from hsstream.tiny_model import hf_hidden_states
    from trainer_client.eagle3 import Eagle3OnlineTrainer, TrainConfig
    from trainer_client.train.vocab import count_tokens
    from trainer_client.stream import Sample

    tok = AutoTokenizer.from_pretrained(verifier)
    docs = corpus_documents(samples, SEED_DRAFT_TRAIN)
    rows = [tok(d, add_special_tokens=False)["input_ids"][:96] for d in docs]
    rows = [r for r in rows if len(r) >= 8]

    class Stream:
        def __iter__(self):  # noqa: ANN204
            rng = random.Random(seed)
            while True:
                for i in rng.sample(range(len(rows)), len(rows)):
                    hs = hf_hidden_states(verifier, rows[i], LAYERS).to(torch.bfloat16)
                    yield Sample(P.SampleKey(job="eval-test", index=i), torch.tensor(rows[i]), hs, LAYERS, 12, None)

        def ack_through(self, key) -> None:  # noqa: ANN001
            pass

    cfg = TrainConfig(verifier=verifier, out_dir=str(out), draft_vocab_size=256, lr=3e-3, warmup_steps=10,
                      max_steps=steps, checkpoint_every=10_000, progress=False, tensorboard=False, threads=1, seed=seed)  # fmt: skip
    r = Eagle3OnlineTrainer(cfg, count_tokens(rows)).train(Stream())
    return Path(r.final_dir)


@pytest.fixture(scope="module")
def verifier() -> str:
    from hsstream.pretrain_verifier import pretrained_verifier

    return str(pretrained_verifier())


@pytest.fixture(scope="module")
def draft(verifier, tmp_path_factory) -> Path:
    return train_draft_from_hf(verifier, tmp_path_factory.mktemp("eval-draft"), samples=150, steps=200)


def hsstream(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsstream", *args], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def test_eval_on_a_jobs_held_out_samples(verifier, draft, tmp_path):
    """``--job ID --eval-fraction F --eval-seed S``: prompts are the job's samples the shared rule
    holds out (those ``hsstream train --eval-fraction F --eval-seed S`` never trains on), read from
    a real sidecar; vLLM serves them as token ids, and our figures are vLLM's own: acceptance rate,
    per position and mean acceptance length within 0.02 of its ``vllm:spec_decode_*`` counters.

    (One engine start proves both: this test took over the former
    ``test_eval_acceptance_is_vllms_own_within_0_02``, which served 16 text prompts through
    ``--prompts`` in an engine of its own; ``--prompts`` is served by test_readme.py's eval.)"""
    from connector.contract.holdout import held_out, sample_identity
    from connector.contract.rest_client import SidecarClient
    from hsstream.evaluate import agreement
    from hsstream.pretrain_verifier import held_out_prompts
    from tests.integration.conftest import sidecar_without_vllm

    rows = [{"prompt": p, "id": f"doc-{i}"} for i, p in enumerate(held_out_prompts(60))]
    with sidecar_without_vllm(verifier, "eval-token", "hsstream-eval-") as sc:
        c = SidecarClient(sc.url, token="eval-token")
        job = c.create_job(rows).job_id
        want = [i for i in range(60) if held_out(sample_identity(f"doc-{i}", i), 0.3, 7)]
        first = [x.token_ids for x in c.iter_job_samples(job) if x.index in want[:12]]
        args = ("eval", "--model", verifier, "--draft", str(draft), "--job", job, "--api", sc.url, "--no-baseline",
                "--json", "--max-tokens", "32", "--workdir", str(tmp_path))  # fmt: skip
        p = hsstream(*args, "--eval-fraction", "0.3", "--eval-seed", "7", "--max-prompts", "12",
                     env={"HSSTREAM_API_TOKEN": "eval-token"})  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        res = json.loads(p.stdout)
        assert res["prompts"] == 12 and res["held_out"]["held_out_read"] == 12 and len(want) >= 12
        served = json.loads((tmp_path / "with-draft.in.json").read_text())["prompts"]
        assert served == [t[: max(1, len(t) // 2)] for t in first]  # plain prompts: their first half, as token ids
        v = res["temperatures"]["0.0"]
        ours, vm = v["ours"], v["vllm_metrics"]
        assert ours["requests_without_record"] == 0
        assert vm["drafts"] > 50 and ours["drafts"] > 50, v
        assert ours["acceptance_rate"] > 0.2, ours  # a draft that learned: the comparison is not 0 against 0
        assert len(ours["acceptance_per_position"]) == 3
        assert agreement(res) <= 0.02, (ours, vm)
        assert abs(ours["mean_acceptance_length"] - vm["mean_acceptance_length"]) <= 0.02 * 3
        # position i+1 can only be accepted after position i: a per-position list out of order is wrong
        pp = ours["acceptance_per_position"]
        assert pp == sorted(pp, reverse=True)
        assert v["tokens_per_s"]["with_draft"] > 0 and v["tokens_per_s"]["without_draft"] is None
        bad = hsstream(*args, env={"HSSTREAM_API_TOKEN": "eval-token"}, timeout=120)  # no fraction
        assert bad.returncode == 2 and "--eval-fraction must be > 0" in bad.stderr, bad.stderr[-2000:]
        wrong = hsstream(*args, "--eval-fraction", "0.3", env={"HSSTREAM_API_TOKEN": "wrong"}, timeout=120)
        assert wrong.returncode == 2 and "401" in wrong.stderr, wrong.stderr[-2000:]


def test_eval_refuses_a_directory_that_is_not_a_draft(verifier, draft, tmp_path):
    p = hsstream("eval", "--model", verifier, "--draft", str(tmp_path), timeout=120)
    assert p.returncode == 2
    assert "no config.json, not a speculators-format draft" in p.stderr
    run_dir = draft.parent  # a run dir: the draft is in its final/
    p = hsstream("eval", "--model", verifier, "--draft", str(run_dir), timeout=120)
    assert p.returncode == 2 and "its draft is in final/" in p.stderr, p.stderr
    p = hsstream("eval", "--model", verifier, "--draft", verifier, timeout=120)  # the verifier itself
    assert p.returncode == 2 and "is not a draft of a kind trained here" in p.stderr, p.stderr


def scrambled_copy(draft: Path, out: Path) -> Path:
    """A draft of ``draft``'s shape that has learned nothing: each trained weight's values rolled
    (the vocabulary maps and the verifier's frozen embeddings kept)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(draft, out)
    w = load_file(str(draft / "model.safetensors"))
    keep = ("t2d", "d2t", "embed_tokens.weight")
    w = {k: (v if k in keep or not v.is_floating_point() else torch.roll(v.flatten(), 7).reshape(v.shape).contiguous())
         for k, v in w.items()}  # fmt: skip
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_one_engine_measures_several_drafts_by_loading_each_in_place(verifier, draft, tmp_path):
    """The swap gate's measure (hsstream/proxy/gate.py): one engine started with the trained draft,
    then a scrambled copy's weights loaded into it in place, then the trained draft's again. At
    temperature 0 the third figure is the first exactly (the load restores the draft module) and the
    second is far below it (the load took effect: a draft that learned nothing accepts little); a
    draft of another shape is refused before any engine starts."""
    from hsstream.measure_in_place import measure_drafts_in_one_engine
    from hsstream.pretrain_verifier import held_out_prompts
    from hsstream.weight_swap import same_shape

    bad = scrambled_copy(draft, tmp_path / "scrambled")
    assert same_shape(draft, bad) and not same_shape(draft, verifier)
    prompts = held_out_prompts(8)
    # float32: the CPU build packs each linear layer's weights for oneDNN at start-up and keeps an
    # empty parameter (in bf16 on a CPU without bf16 instructions oneDNN declines and the weights
    # stay): the in-place load must go through vLLM's layer-wise reload (hsstream/weight_swap.py)
    res = measure_drafts_in_one_engine(verifier, [str(draft), str(bad), str(draft)], prompts, max_tokens=24,
                                       workdir=tmp_path / "wd", dtype="float32")  # fmt: skip
    m = [r["vllm_metrics"] for r in res]
    assert [r["draft"] for r in res] == [str(draft), str(bad), str(draft)]
    assert m[0]["drafts"] > 20 and m[0]["accepted"] > 0, m
    assert (m[2]["drafts"], m[2]["accepted"]) == (m[0]["drafts"], m[0]["accepted"]), m
    assert m[1]["mean_acceptance_length"] < m[0]["mean_acceptance_length"] - 0.2, m
    with pytest.raises(ValueError, match="cannot load in place"):
        measure_drafts_in_one_engine(verifier, [str(draft), verifier], prompts, workdir=tmp_path / "wd2")
