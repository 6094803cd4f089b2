"""The sidecar and `hsstream up` refuse a spool directory that is not theirs, deleting nothing:
real processes (`python -m hsstream serve|up`), a real /dev/shm directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hsstream import launch
from hsstream.devstack import free_port

WEIGHTS = os.urandom(4096)


@pytest.fixture
def model_folder():
    d = Path(tempfile.mkdtemp(prefix="hsstream-notours-", dir="/dev/shm"))
    (d / "model.safetensors").write_bytes(WEIGHTS)
    (d / "config.json").write_text("{}")
    yield d
    shutil.rmtree(d)


@pytest.mark.parametrize("cmd", [["serve"], ["up", "--max-model-len", "256"]])
def test_spool_pointed_at_a_model_folder_is_refused_and_untouched(model_folder, tiny_model, tmp_path, cmd):
    env = launch.child_env({
        "HSSTREAM_SPOOL_DIR": str(model_folder), "HSSTREAM_RUN_DIR": str(tmp_path / "run"),
        "HSSTREAM_PORT": str(free_port()), "HSSTREAM_MODEL": tiny_model, "HSSTREAM_LAYER_IDS": "2,6,9,12",
        "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{free_port()}",
    })  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "hsstream", *cmd], env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "is not empty (config.json, model.safetensors) and has no .hsstream-spool marker" in out, out
    assert "Traceback" not in out, out
    assert (model_folder / "model.safetensors").read_bytes() == WEIGHTS
    assert sorted(os.listdir(model_folder)) == ["config.json", "model.safetensors"]
