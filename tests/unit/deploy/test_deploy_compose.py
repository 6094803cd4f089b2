"""deploy/compose.yaml, checked by a real Compose implementation and against our own CLI.

No container engine runs here, so what can go wrong is checked without one: Compose itself
resolves the file with deploy/.env.example (`config`), for the default (gpu) and the cpu
profile; every command of ours the file runs must be a real entry point whose flags parse;
the vLLM services' command, run up to the exec, must name our connector by a module path that
imports; and ``hsstream up`` must read the same .env into the same entry point. The checks
over commands are driven by the file, so a command added to compose (or a flag renamed in the
CLI) is checked without editing this test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import import_module, metadata
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from hsstream import launch
from hsstream.cli import app

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
ENV_EXAMPLE = DEPLOY / ".env.example"
REMOTE = DEPLOY / "compose.remote.yaml"
PROFILES = {"default": [], "cpu": ["--profile", "cpu"]}
ROLES = ("vllm", "sidecar", "trainer")


def compose_cmd() -> list[str]:
    """Debian's docker-compose (v1.29) as CI installs it, else the v2 plugin; never skipped."""
    if exe := shutil.which("docker-compose"):
        return [exe]
    if shutil.which("docker"):
        p = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if p.returncode == 0:
            return ["docker", "compose"]
    pytest.fail(
        "no Compose implementation found: deploy/compose.yaml must be validated by a real one. "
        "Install it with `make compose-tool` (apt-get install docker-compose) and run the tests again."
    )


def run_compose(profile: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "HSSTREAM_"))}
    return subprocess.run(
        [*compose_cmd(), "--env-file", str(ENV_EXAMPLE), "-f", str(COMPOSE), *PROFILES[profile], *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip


def env_example() -> dict[str, str]:
    from dotenv import dotenv_values

    return {k: v for k, v in dotenv_values(ENV_EXAMPLE).items() if v is not None}


def active_profiles(profile: str) -> set[str]:
    return {"cpu"} if profile == "cpu" else set(env_example()["COMPOSE_PROFILES"].split(","))


_resolved: dict[str, dict] = {}


def resolved(profile: str) -> dict:
    """The file as Compose resolves it, with only the services the profile starts."""
    if profile not in _resolved:
        p = run_compose(profile, "config")
        assert p.returncode == 0, f"compose config failed for profile {profile}:\n{p.stderr}"
        cfg = yaml.safe_load(p.stdout)
        on = active_profiles(profile)
        cfg["services"] = {n: s for n, s in cfg["services"].items() if not s.get("profiles") or set(s["profiles"]) & on}
        _resolved[profile] = cfg
    return _resolved[profile]


def role(cfg: dict, name: str) -> tuple[str, dict]:
    """The service playing a role (vllm / sidecar / trainer) in this profile."""
    hits = [(n, s) for n, s in cfg["services"].items() if n == name or n.startswith(f"{name}-")]
    assert len(hits) == 1, f"expected one {name} service, found {[n for n, _ in hits]}"
    return hits[0]


def argv(svc: dict) -> list[str]:
    ep, cmd = svc.get("entrypoint") or [], svc.get("command") or []
    ep = ep.split() if isinstance(ep, str) else ep
    cmd = cmd.split() if isinstance(cmd, str) else cmd
    return [str(x) for x in [*ep, *cmd]]


def mounts(svc: dict) -> dict[str, str]:
    """target -> source for every volume of a service (v1 prints strings, v2 mappings)."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            src, tgt = v.split(":")[:2]
        else:
            src, tgt = v.get("source"), v["target"]
        out[tgt] = src
    return out


# ----------------------------------------------------------------------------- Compose itself


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_validates_the_file_with_env_example(profile):
    p = run_compose(profile, "config", "-q")
    assert p.returncode == 0, f"`compose {' '.join(PROFILES[profile])} config -q` failed:\n{p.stderr}"
    # every variable the file uses is given by .env.example (Compose warns about unset ones)
    assert "is not set" not in p.stderr, p.stderr


def test_every_variable_in_compose_is_documented_in_env_example():
    for f in (COMPOSE, REMOTE):
        used = set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", f.read_text()))  # $${X}: the container's own
        missing = sorted(used - set(env_example()))
        assert not missing, f"deploy/.env.example does not document {missing}, used in {f.name}"


def test_remote_add_on_opens_a_curve_endpoint_on_the_sidecar_only():
    p = run_compose("default", "-f", str(REMOTE), "config")  # a second -f: the add-on over the base
    assert p.returncode == 0 and "is not set" not in p.stderr, p.stderr
    cfg = yaml.safe_load(p.stdout)
    sc = cfg["services"]["sidecar"]
    env = sc["environment"]
    assert env["HSSTREAM_REMOTE_ENDPOINT"].startswith("tcp://")
    assert env["HSSTREAM_CURVE_CLIENTS_DIR"].startswith("/keys/")
    assert env["HSSTREAM_CURVE_SERVER_SECRET_FILE"].endswith(".key_secret") and "/keys" in mounts(sc)
    assert env["HSSTREAM_SPOOL_DIR"] == "/spool" and env["HSSTREAM_VLLM_URL"] == "http://vllm:8000"  # base kept
    for name in ("vllm", "trainer"):
        assert "HSSTREAM_REMOTE_ENDPOINT" not in cfg["services"][name]["environment"]


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_runs_vllm_sidecar_trainer_with_health_ordering(profile):
    cfg = resolved(profile)
    names = {r: role(cfg, r)[0] for r in ROLES}
    assert len(cfg["services"]) == 3, f"profile {profile} starts {sorted(cfg['services'])}"
    vllm, sidecar, trainer = (cfg["services"][names[r]] for r in ROLES)
    assert sidecar["depends_on"] == {names["vllm"]: {"condition": "service_healthy"}}
    assert trainer["depends_on"] == {names["sidecar"]: {"condition": "service_healthy"}}
    for svc in (vllm, sidecar):
        assert svc["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    assert vllm["restart"] in ("unless-stopped", "always") and trainer["restart"] == "on-failure"


@pytest.mark.parametrize("profile", PROFILES)
def test_one_tmpfs_spool_and_one_socket_dir_shared_by_all_three(profile):
    cfg = resolved(profile)
    spool_size = env_example()["SPOOL_SIZE"]
    assert cfg["volumes"]["spool"]["driver_opts"]["type"] == "tmpfs"
    assert f"size={spool_size}" in cfg["volumes"]["spool"]["driver_opts"]["o"]
    assert cfg["volumes"]["run"]["driver_opts"]["type"] == "tmpfs"
    for r in ROLES:
        name, svc = role(cfg, r)
        env, m = svc["environment"], mounts(svc)
        assert m.get(env["HSSTREAM_SPOOL_DIR"]) == "spool", f"{name}: spool not mounted at HSSTREAM_SPOOL_DIR"
        assert m.get(env["HSSTREAM_RUN_DIR"]) == "run", f"{name}: socket volume not mounted at HSSTREAM_RUN_DIR"
        assert "HSSTREAM_NOTICE_ENDPOINT" not in env and "HSSTREAM_DELIVERY_ENDPOINT" not in env  # ipc:// in run
    _, trainer = role(cfg, "trainer")
    assert Path(mounts(trainer)["/checkpoints"]).is_absolute()  # a host folder: test_compose_trainer.py


def test_gpus_are_split_between_vllm_and_trainer():
    cfg, e = resolved("default"), env_example()
    devs = {}
    for r in ("vllm", "trainer"):
        _, svc = role(cfg, r)
        (d,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert d["capabilities"] == ["gpu"]
        devs[r] = d["device_ids"]
    assert devs == {"vllm": [e["VLLM_GPUS"]], "trainer": [e["TRAINER_GPUS"]]}
    assert set(e["VLLM_GPUS"].split(",")).isdisjoint(e["TRAINER_GPUS"].split(","))
    _, v = role(cfg, "vllm")
    a = argv(v)
    assert a[a.index("--tensor-parallel-size") + 1] == e["TENSOR_PARALLEL_SIZE"]
    assert a[a.index("--data-parallel-size") + 1] == e["DATA_PARALLEL_SIZE"]
    for _, svc in cfg["services"].items():
        assert svc["environment"].get("HSSTREAM_API_TOKEN", "") == e["HSSTREAM_API_TOKEN"]


def test_images_gpu_from_vllm_release_cpu_from_base_image_with_cpu_extra():
    gpu = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}", gpu, re.M)
    assert env_example()["VLLM_IMAGE"].startswith("vllm/vllm-openai:")
    cpu = (DEPLOY / "Dockerfile.cpu").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", cpu, re.M) and re.search(r"^FROM \$\{BASE_IMAGE\}", cpu, re.M)
    assert env_example()["BASE_IMAGE"] == "python:3.11-slim"
    assert "download.pytorch.org/whl/cpu" in cpu and "requirements-linux-$(uname -m)-image.txt" in cpu  # the lock
    _, v = role(resolved("cpu"), "vllm")
    tiny = v["environment"]["HSSTREAM_MODEL"]
    assert f"--out {tiny}" in cpu, "the cpu image must build the tiny verifier where compose points"
    for profile, dockerfile in (("default", "deploy/Dockerfile"), ("cpu", "deploy/Dockerfile.cpu")):
        _, v = role(resolved(profile), "vllm")
        assert v["build"]["dockerfile"] == dockerfile and Path(v["build"]["context"]).resolve() == ROOT
    # the root .dockerignore (the one every builder reads) keeps .venv and .git out: test_deploy_images.py
    assert (ROOT / ".dockerignore").is_file(), "the build context would include .venv and .git"


# ----------------------------------------------------------------------------- our commands


def commands_in_compose(tmp: Path) -> list[tuple[str, str, list[str]]]:
    """Each service's command line; the trainer's as its entry script builds it from the
    service's environment (tests/unit/deploy/test_compose_trainer.py runs the script)."""
    from tests.unit.deploy.test_compose_trainer import argv_of

    out = []
    for profile in PROFILES:
        for name, svc in resolved(profile)["services"].items():
            a = argv(svc)
            if a[:2] == ["sh", "-c"]:
                a = ["hsstream", *argv_of(svc, tmp)]
            out.append((profile, name, a))
    return out


def test_every_hsstream_command_in_compose_is_an_entry_point_whose_flags_parse(tmp_path):
    (ep,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "hsstream"]
    assert ep.load() is import_module("hsstream.cli").main
    group = typer.main.get_command(app)
    checked = []
    for profile, name, a in commands_in_compose(tmp_path):
        assert a and a[0] == "hsstream", f"{profile}/{name} runs {a[:2]}, not one of our commands"
        sub = a[1]
        assert sub in group.commands, f"{profile}/{name}: `hsstream {sub}` is not a command ({sorted(group.commands)})"
        cmd = group.commands[sub]
        try:
            with cmd.make_context(f"hsstream {sub}", a[2:], resilient_parsing=False):
                pass
        except typer.TyperException as e:  # flag renamed or missing in the CLI: say which
            msg = getattr(e, "format_message", e.__str__)()
            pytest.fail(f"{profile}/{name}: `{' '.join(a)}` does not parse: {msg}")
        checked.append((profile, sub))
    assert {s for _, s in checked} == {"vllm", "serve", "train"} and len(checked) == 6


@pytest.fixture
def qwen3_8b_shape(tmp_path):
    """The GPU profile's verifier shape (36 layers), without weights: enough to build the command."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 36, "hidden_size": 4096}))
    return str(tmp_path)


@pytest.mark.parametrize("profile", PROFILES)
def test_vllm_service_execs_vllm_with_our_connector(profile, monkeypatch, qwen3_8b_shape, tiny_model):
    """Run the vLLM service's command in-process up to the exec and look at what it would exec."""
    name, svc = role(resolved(profile), "vllm")
    a = argv(svc)
    env = dict(svc["environment"])
    local_model = tiny_model if profile == "cpu" else qwen3_8b_shape  # the container path is not here
    env["HSSTREAM_MODEL"] = local_model
    for k in [k for k in os.environ if k.startswith("HSSTREAM_")]:
        monkeypatch.delenv(k)
    execs = []

    def fake_exec(path, args, env):  # noqa: ANN001
        execs.append(list(args))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvpe", fake_exec)
    r = CliRunner().invoke(app, a[1:], env=env, catch_exceptions=False)
    assert r.exit_code == 0 and len(execs) == 1, f"{name}: {r.output}"
    args = execs[0]
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kvt = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    ids = [int(x) for x in env["HSSTREAM_LAYER_IDS"].split(",")]
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    assert kvt["kv_connector"] == launch.CONNECTOR_CLASS
    module = import_module(kvt["kv_connector_module_path"])  # vLLM imports it by this path
    assert getattr(module, kvt["kv_connector"]).__module__ == kvt["kv_connector_module_path"]
    extra = kvt["kv_connector_extra_config"]
    assert extra["shared_storage_path"] == env["HSSTREAM_SPOOL_DIR"]
    assert extra["notice_endpoint"] == f"ipc://{env['HSSTREAM_RUN_DIR']}/notice.sock"
    port = args[args.index("--port") + 1]
    assert f":{port}/health" in " ".join(svc["healthcheck"]["test"])
    published = [str(p.get("target") if isinstance(p, dict) else p).split(":")[-1].split("/")[0] for p in svc["ports"]]
    assert port in published
    assert args[args.index("--host") + 1] == "0.0.0.0"  # reachable from the sidecar's container
    if profile == "default":
        assert "--tensor-parallel-size" in args and "--data-parallel-size" in args


# ----------------------------------------------------------------------------- hsstream up reads the same .env


def test_up_reads_the_same_env_into_the_same_entry_point(tmp_path, monkeypatch, qwen3_8b_shape, up_spawns):
    from hsstream.up import build_config

    for k in [k for k in os.environ if k.startswith(("HSSTREAM_", "VLLM_", "MODEL_", "TENSOR_", "DATA_"))]:
        monkeypatch.delenv(k)
    text = ENV_EXAMPLE.read_text()
    text = re.sub(r"^MODEL_DIR=.*$", "MODEL_DIR=model", text, flags=re.M)
    text = re.sub(r"^TENSOR_PARALLEL_SIZE=.*$", "TENSOR_PARALLEL_SIZE=2", text, flags=re.M)
    (tmp_path / "model").symlink_to(qwen3_8b_shape)
    envf = tmp_path / ".env"
    envf.write_text(text)
    monkeypatch.setenv("HSSTREAM_PORT", "9999")  # the shell wins over the file, as with compose
    cfg = build_config(env_file=str(envf))
    e = env_example()
    assert cfg.model == str((tmp_path / "model").resolve()) and cfg.api_port == 9999
    assert cfg.layer_ids == [int(x) for x in e["HSSTREAM_LAYER_IDS"].split(",")]
    assert cfg.vllm_port == int(e["VLLM_PORT"]) and cfg.vllm_gpus == e["VLLM_GPUS"]
    assert cfg.trainer_gpus == e["TRAINER_GPUS"]
    assert cfg.env["HSSTREAM_SPOOL_BUDGET_BYTES"] == e["HSSTREAM_SPOOL_BUDGET_BYTES"]
    # `up` starts vLLM through the compose vLLM service's entry point, with flags that parse
    vllm_cmd = typer.main.get_command(app).commands["vllm"]
    with vllm_cmd.make_context("hsstream vllm", list(cfg.vllm_cli)) as ctx:
        assert ctx.params["gpu_memory_utilization"] == float(e["GPU_MEMORY_UTILIZATION"])
        # (a tuple in ctx.params before typer 0.29, a list since; the command itself gets a list)
        assert list(ctx.params["vllm_args"]) == ["--tensor-parallel-size", "2"]
    # and the process it spawns is that entry point, with those flags
    from hsstream import up

    with pytest.raises(OSError, match="not starting"):
        up.Supervisor(cfg, echo=False)._spawn_vllm()
    (args, env), = up_spawns
    assert args == [sys.executable, "-m", "hsstream", "vllm", *cfg.vllm_cli]
    assert env["CUDA_VISIBLE_DEVICES"] == e["VLLM_GPUS"] and env["HSSTREAM_SPOOL_DIR"] == str(cfg.spool_dir)


def test_up_refuses_bad_layer_ids_before_starting_anything(tmp_path, monkeypatch, qwen3_8b_shape):
    from hsstream.up import UpError, build_config

    monkeypatch.setenv("HSSTREAM_MODEL", qwen3_8b_shape)
    with pytest.raises(UpError, match=r"\[40\] outside 0..36"):
        build_config(layer_ids="2,18,40")
    with pytest.raises(UpError, match="env file .* not found"):
        build_config(env_file=str(tmp_path / "nope.env"))
    monkeypatch.setenv("HSSTREAM_MODEL", str(tmp_path / "missing"))
    with pytest.raises(UpError, match=r"model folder .*missing does not exist"):
        build_config()


def _up_env(tmp_path, tiny_model, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSSTREAM_")}
    env.update({
        "HSSTREAM_MODEL": tiny_model, "HSSTREAM_RUN_DIR": str(tmp_path / "run"),
        "HSSTREAM_SPOOL_DIR": str(tmp_path / "spool"), **extra,
    })  # fmt: skip
    return env


def test_up_fails_fast_and_clearly_when_a_port_is_taken(tmp_path, tiny_model):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = _up_env(tmp_path, tiny_model, HSSTREAM_PORT=str(port))
        p = subprocess.run([sys.executable, "-m", "hsstream", "up"], env=env, capture_output=True, text=True,
                           timeout=120, cwd=ROOT)  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert f"port {port} on 127.0.0.1 (for the sidecar) is already in use" in p.stderr
    assert "started" not in p.stderr  # nothing was spawned
    assert not (tmp_path / "spool").exists()


def test_a_second_up_on_the_same_run_dir_is_refused(tmp_path, tiny_model):
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    with open(run / "up.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("4242")
        f.flush()
        p = subprocess.run([sys.executable, "-m", "hsstream", "up"], env=_up_env(tmp_path, tiny_model),
                           capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert p.returncode == 1 and "another `hsstream up` (pid 4242) uses run dir" in p.stderr, p.stderr


def test_up_checks_the_trainer_command_before_starting(tmp_path, tiny_model):
    args = [sys.executable, "-m", "hsstream", "up", "--train", "--no-such-flag"]
    p = subprocess.run(args, env=_up_env(tmp_path, tiny_model), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "--train" in p.stderr and "no-such-flag" in p.stderr, p.stderr
    assert "started" not in p.stderr
