"""The vLLM command line is built in one place and refuses bad layer ids before any engine."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from connector.layers import LayerIdError
from hsstream import launch


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 12, "hidden_size": 8}))
    return str(tmp_path)


def opts(model_dir, ids):
    return launch.VllmOptions(model=model_dir, layer_ids=ids, spool_dir="/dev/shm/x", notice_endpoint="ipc:///tmp/n")


def test_args_name_our_connector_and_keep_user_order(model_dir):
    args = launch.vllm_args(opts(model_dir, [5, 2, 10]))
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kvt = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [5, 2, 10]
    assert kvt["kv_connector_module_path"] == "connector.vllm_plugin"
    assert kvt["kv_connector_extra_config"]["layer_ids"] == [5, 2, 10]
    assert "--no-enable-prefix-caching" in args


def test_duplicate_layer_ids_refused_naming_the_duplicate(model_dir):
    with pytest.raises(LayerIdError, match=r"duplicate layer id\(s\) \[2\]"):
        launch.vllm_args(opts(model_dir, [2, 2, 5]))


def test_out_of_range_layer_ids_refused(model_dir):
    with pytest.raises(LayerIdError, match=r"\[13\] outside 0..12"):
        launch.vllm_args(opts(model_dir, [2, 13]))


def test_cli_refuses_duplicates_before_starting_anything(model_dir):
    p = subprocess.run(
        [sys.executable, "-m", "hsstream", "vllm", "--model", model_dir, "--layer-ids", "2,2,5", "--dry-run"],
        capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 2 and "duplicate layer id(s) [2]" in p.stderr


def test_cli_dry_run_prints_the_command(model_dir):
    p = subprocess.run(
        [sys.executable, "-m", "hsstream", "vllm", "--model", model_dir, "--dry-run"],
        capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "vllm.entrypoints.openai.api_server" in p.stdout and "[2, 6, 9, 12]" in p.stdout


def test_plain_args_have_no_extraction_but_same_server(model_dir):
    o = opts(model_dir, [5, 2, 10])
    o.extraction = False
    args = launch.vllm_args(o)
    assert "--speculative-config" not in args and "--kv-transfer-config" not in args
    assert args[:3] == launch.vllm_args(opts(model_dir, [5, 2, 10]))[:3]
    assert "--no-enable-prefix-caching" in args


@pytest.mark.parametrize(("gpus", "tp", "want"), [
    (1, 1, []),
    (2, 2, ["--tensor-parallel-size", "2"]),
    (2, 1, ["--data-parallel-size", "2"]),
    (4, 2, ["--tensor-parallel-size", "2", "--data-parallel-size", "2"]),
    (7, 1, ["--data-parallel-size", "7"]),
])  # fmt: skip
def test_parallel_args_split_gpus_into_tp_groups(gpus, tp, want):
    assert launch.parallel_args(gpus, tp) == want


def test_parallel_args_refuse_an_uneven_split():
    with pytest.raises(ValueError, match="3 GPU"):
        launch.parallel_args(3, 2)


@pytest.mark.parametrize("kind, want", [
    ("eagle3", {"method": "eagle3", "num_speculative_tokens": 4}),  # its TTT steps, as speculators saved them
    ("peagle", {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": 4}),
    ("dflash", {"method": "dflash", "num_speculative_tokens": 5}),
])  # fmt: skip
def test_a_served_draft_gets_its_methods_speculative_config(model_dir, tmp_path, kind, want):
    d = tmp_path / kind
    d.mkdir()
    conf = {"speculators_model_type": kind, "block_size": 6,
            "speculators_config": {"proposal_methods": [{"speculative_tokens": 4}]}}  # fmt: skip
    (d / "config.json").write_text(json.dumps(conf))
    (d / "model.safetensors").write_bytes(b"")
    o = launch.VllmOptions(model=model_dir, layer_ids=[], spool_dir="", notice_endpoint="", extraction=False, draft=str(d))
    args = launch.vllm_args(o)
    assert "--kv-transfer-config" not in args
    assert json.loads(args[args.index("--speculative-config") + 1]) == {**want, "model": str(d.resolve())}
    with pytest.raises(ValueError, match="pick one"):
        launch.vllm_args(opts(model_dir, [2, 6, 9]).__class__(**{**opts(model_dir, [2, 6, 9]).__dict__, "draft": str(d)}))


# ---- the dtype vLLM's CPU build serves in (float32 where bf16 is emulated) ----


def _half_model(tmp_path, dtype="bfloat16", key="dtype"):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 12, key: dtype}))
    return str(tmp_path)


def test_a_bf16_checkpoint_is_served_in_float32_on_a_cpu_without_bf16(tmp_path, monkeypatch):
    monkeypatch.delenv(launch.DTYPE_ENV, raising=False)
    m = _half_model(tmp_path)
    assert launch.cpu_serving_dtype(m, cpu=True, flags={"avx2", "avx512f"}) == "float32"
    assert launch.cpu_serving_dtype(_half_model(tmp_path, "float16", "torch_dtype"), cpu=True, flags=set()) == "float32"
    # bf16 in hardware, a GPU build, a float32 checkpoint, or the user's own --dtype: vLLM's choice stands
    assert launch.cpu_serving_dtype(m, cpu=True, flags={"avx512_bf16"}) is None
    assert launch.cpu_serving_dtype(m, cpu=True, flags={"amx_bf16", "amx_tile"}) is None
    assert launch.cpu_serving_dtype(m, cpu=False, flags=set()) is None
    assert launch.cpu_serving_dtype(_half_model(tmp_path, "float32"), cpu=True, flags=set()) is None
    assert launch.cpu_serving_dtype(m, ["--dtype", "bfloat16"], cpu=True, flags=set()) is None
    assert launch.cpu_serving_dtype(m, ["--dtype=half"], cpu=True, flags=set()) is None


def test_the_environment_overrides_the_choice(tmp_path, monkeypatch):
    m = _half_model(tmp_path)
    monkeypatch.setenv(launch.DTYPE_ENV, "auto")
    assert launch.cpu_serving_dtype(m, cpu=True, flags=set()) is None
    monkeypatch.setenv(launch.DTYPE_ENV, "float16")
    assert launch.cpu_serving_dtype(m, cpu=True, flags={"avx512_bf16"}) == "float16"


def test_the_vllm_command_carries_the_chosen_dtype(tmp_path, monkeypatch):
    monkeypatch.delenv(launch.DTYPE_ENV, raising=False)
    monkeypatch.setattr(launch, "is_cpu_build", lambda: True)
    monkeypatch.setattr("hsstream.amx.cpu_flags", lambda cpuinfo=None: {"avx2"})
    args = launch.vllm_args(opts(_half_model(tmp_path), [2, 5]))
    assert args[args.index("--dtype") + 1] == "float32"
    monkeypatch.setattr("hsstream.amx.cpu_flags", lambda cpuinfo=None: {"avx512_bf16"})
    assert "--dtype" not in launch.vllm_args(opts(_half_model(tmp_path), [2, 5]))


def test_children_start_from_the_base_environment_they_are_given(monkeypatch, tmp_path):
    """``child_env(base=...)`` and ``UpConfig.base_env``: a stack started from a thread while the
    rest of the process changes its environment (tests/support/prestart.py) gets the environment
    it was given, not what a running test has set since; without a base, this process's as it is now."""
    import os
    from pathlib import Path

    from hsstream import up

    monkeypatch.setenv("HSSTREAM_SET_MEANWHILE", "1")
    base = {"PATH": os.environ["PATH"], "HSSTREAM_FROM_BASE": "b"}
    env = launch.child_env({"HSSTREAM_EXTRA": "x"}, base=base)
    assert "HSSTREAM_SET_MEANWHILE" not in env and env["HSSTREAM_FROM_BASE"] == "b" and env["HSSTREAM_EXTRA"] == "x"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == launch.repo_root()
    assert launch.child_env()["HSSTREAM_SET_MEANWHILE"] == "1"
    cfg = up.UpConfig(model="m", layer_ids=[1], spool_dir=tmp_path, run_dir=tmp_path, api_host="127.0.0.1", api_port=1,
                      vllm_host="127.0.0.1", vllm_port=2, vllm_cli=[], env={"HSSTREAM_EXTRA": "x"}, base_env=base,
                      log_dir=tmp_path)  # fmt: skip
    sup = up.Supervisor(cfg, echo=False)
    probe = "import os; print(os.environ.get('HSSTREAM_SET_MEANWHILE'), os.environ.get('HSSTREAM_FROM_BASE'))"
    p = sup._spawn("probe", [sys.executable, "-c", probe])
    p.proc.wait(60)
    time.sleep(0.5)  # the output is streamed to the log by a thread
    assert Path(tmp_path / "probe.log").read_text().split() == ["None", "b"]
