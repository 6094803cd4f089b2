"""The briefly pre-trained tiny verifier that acceptance is measured on: it must not loop.

No vLLM here (plain transformers), but it sits with the slow tests: the first run on a machine
pre-trains for a few minutes (then the result is cached by content hash).
"""

from __future__ import annotations

import json
import time

from hsstream import pretrain_verifier as PV
from hsstream.tiny_model import build_tiny_verifier


def test_pretrained_verifier_stops_repeating_its_last_token():
    t0 = time.monotonic()
    path = PV.pretrained_verifier()
    built_s = time.monotonic() - t0
    base = build_tiny_verifier()
    assert path.name == f"tiny-qwen3-pretrained-{PV.content_hash(base, PV.PretrainConfig())}"
    report = json.loads((path / PV.REPORT_NAME).read_text())
    prompts = PV.held_out_prompts(16)
    random_rep = PV.greedy_repeat_fraction(base, prompts)
    trained_rep = PV.greedy_repeat_fraction(path, prompts)
    print(f"greedy repeat fraction: random verifier {random_rep:.3f}, pre-trained {trained_rep:.3f} "
          f"(built or found in {built_s:.0f} s)")  # fmt: skip
    assert random_rep > 0.3  # the random one loops: acceptance measured on it would mean nothing
    assert trained_rep < 0.3
    assert abs(trained_rep - report["greedy_repeat_fraction"]) < 1e-9  # same measurement as at build time
    # a second call finds the build instead of training again
    t0 = time.monotonic()
    assert PV.pretrained_verifier() == path and time.monotonic() - t0 < 10


def test_corpora_are_seeded_and_disjoint():
    assert PV.corpus_documents(5, 1) == PV.corpus_documents(5, 1)
    train = set(PV.corpus_documents(200, PV.SEED_DRAFT_TRAIN))
    held = PV.held_out_prompts(50)
    assert not any(p in d for p in held for d in train)
    assert set(PV.corpus_documents(200, PV.SEED_PRETRAIN)).isdisjoint(train)
