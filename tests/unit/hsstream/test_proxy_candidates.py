"""autoswap's copies of the checkpoints it gates and swaps in (hsstream/proxy/candidates.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from hsstream.proxy.candidates import DIR, Candidates


def ckpt(tmp_path, step: int):
    d = tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "draft"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(bytes([step % 256]) * 64)
    return d


def test_a_candidate_outlives_the_checkpoint_the_trainer_prunes(tmp_path):
    c = Candidates(tmp_path / "run")
    src = ckpt(tmp_path, 42)
    copy = c.take(src, "train-step42")
    shutil.rmtree(src.parent)  # the trainer's --keep-checkpoints, while the gate's engine starts
    assert copy == tmp_path / "run" / DIR / "train-step42"
    assert (copy / "model.safetensors").read_bytes() == bytes([42]) * 64 and (copy / "config.json").exists()


def test_refused_ones_go_at_once_and_of_the_swapped_in_the_newest_two_stay(tmp_path):
    c = Candidates(tmp_path / "run", keep=2)
    refused = c.take(ckpt(tmp_path, 1), "v1")
    c.drop(refused)
    assert not refused.exists()
    done = []
    for step in (2, 3, 4):
        done.append(c.take(ckpt(tmp_path, step), f"v{step}"))
        c.swapped_in(done[-1])
    assert [d.exists() for d in done] == [False, True, True]
    assert sorted(p.name for p in (tmp_path / "run" / DIR).iterdir()) == ["v3", "v4"]
    c.drop(done[-1])  # a swapped-in copy is never dropped by a later failure's cleanup
    assert done[-1].exists()


def test_a_restart_counts_what_is_there_as_swapped_in_and_clears_cut_copies(tmp_path):
    c = Candidates(tmp_path / "run", keep=3)
    olds = []
    for step in (5, 6, 7):
        olds.append(c.take(ckpt(tmp_path, step), f"v{step}"))
        c.swapped_in(olds[-1])
        os.utime(olds[-1], (1000 + step, 1000 + step))
    (tmp_path / "run" / DIR / ".v8.partial").mkdir()  # killed mid-copy
    Candidates(tmp_path / "run", keep=2)
    assert sorted(p.name for p in (tmp_path / "run" / DIR).iterdir()) == ["v6", "v7"]


def test_a_checkpoint_gone_before_the_copy_leaves_nothing_and_says_so(tmp_path):
    c = Candidates(tmp_path / "run")
    with pytest.raises(OSError):
        c.take(tmp_path / "run" / "checkpoints" / "step-00000009" / "draft", "v9")
    assert list((tmp_path / "run" / DIR).iterdir()) == []
    with pytest.raises(ValueError):
        c.take(ckpt(tmp_path, 10), "../x")
