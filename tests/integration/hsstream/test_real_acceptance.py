"""The real model, trained online, serves faster than untrained: SmolLM2-135M-Instruct regenerates
replies to ShareGPT prompts through vLLM (CPU build) and our connector, ``hsstream train`` trains
an Eagle-3 draft from the stream, and ``hsstream eval`` serves it and an untrained one (same
architecture and vocabulary maps) on held-out ShareGPT prompts: the trained draft's mean
acceptance length at T=0 (vLLM's counters) must be at least :data:`MARGIN` above the untrained
one's, with nothing lost or left in the spool and the held-out prompts disjoint from training.

Minutes on 2 cores, so it is opt-in (``make test-real``, ``pytest tests -m real_acceptance``;
tests/conftest.py leaves it out of ``make test``). It runs ``bench/served_acceptance/real_acceptance.py`` (the
measurement ``make demo`` makes) at a smaller size and reads its JSON, not its exit status alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_acceptance

ROOT = Path(__file__).resolve().parents[3]
MARGIN = 0.3
#: Smaller than the demo's: fewer training prompts and held-out prompts, shorter replies.
SIZE = ["--train-prompts", "192", "--eval-prompts", "16", "--reply-tokens", "96", "--max-tokens", "48"]


def test_trained_draft_beats_untrained_on_the_real_model(smollm2, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "bench/served_acceptance/real_acceptance.py"), "--model", smollm2, *SIZE,
           "--margin", str(MARGIN), "--workdir", str(tmp_path / "wd"), "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    tail = (p.stdout + p.stderr)[-4000:]
    assert out.exists(), tail
    d = json.loads(out.read_text())
    tr, un = d["acceptance"]["trained"]["T0"], d["acceptance"]["untrained"]["T0"]
    gain = tr["mean_acceptance_length"] - un["mean_acceptance_length"]
    assert gain >= MARGIN, f"trained {tr['mean_acceptance_length']:.3f} vs untrained {un['mean_acceptance_length']:.3f}\n{tail}"
    split = d["data"]["split"]
    assert split["common_prompt_hashes"] == 0 and split["common_record_ids"] == 0
    assert d["passed"] and all(d["checks"].values()), d["checks"]
    assert p.returncode == 0, tail
