"""Secure defaults (issue 10, item 3): what listens where, who may read what.

Real processes where the behaviour is a process's (``hsstream serve``/``up``/``keys``/``vllm``
run as a user runs them), real files and modes, real Compose for the compose file.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from connector.contract import curve_keys
from hsstream.cli import app
from hsstream.devstack import free_port
from hsstream.exposure import OpenBindRefused, check_api_exposure, is_loopback

ROOT = Path(__file__).resolve().parents[3]


def _mode(p) -> int:  # noqa: ANN001
    return stat.S_IMODE(os.stat(p).st_mode)


def _env(tmp_path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSSTREAM_")}
    env.update({"HSSTREAM_RUN_DIR": str(tmp_path / "run"), "HSSTREAM_SPOOL_DIR": str(tmp_path / "spool"),
                "PYTHONPATH": str(ROOT), **extra})  # fmt: skip
    return env


def _hsstream(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsstream", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


# ----------------------------------------------------------------------------- vLLM's bind


def test_hsstream_vllm_binds_loopback_unless_told(tiny_model, monkeypatch):
    for k in [k for k in os.environ if k.startswith("HSSTREAM_")]:
        monkeypatch.delenv(k)
    base = ["vllm", "--model", tiny_model, "--layer-ids", "2,6,9,12", "--dry-run"]
    for extra, want in (([], "127.0.0.1"), (["--host", "0.0.0.0"], "0.0.0.0")):
        r = CliRunner().invoke(app, [*base, *extra], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        args = r.output.split()
        assert args[args.index("--host") + 1] == want


# ----------------------------------------------------------------------------- the sidecar's bind


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_token(host):
    assert is_loopback(host) and check_api_exposure(host, None, False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "sidecar.example.com", ""])
def test_reachable_address_without_a_real_token_is_refused(host):
    assert not is_loopback(host)
    for token in (None, "", "change-me"):
        with pytest.raises(OpenBindRefused, match=r"refusing to serve the REST API on .* Set HSSTREAM_API_TOKEN"):
            check_api_exposure(host, token, False)
    assert check_api_exposure(host, "3f9a0c51d84b7a6e", False) is None
    warning = check_api_exposure(host, None, True)
    assert warning.startswith("WARNING") and "anyone who can reach this address" in warning


def test_serve_refuses_0_0_0_0_without_token_before_creating_anything(tmp_path):
    p = _hsstream("serve", env=_env(tmp_path, HSSTREAM_HOST="0.0.0.0", HSSTREAM_PORT=str(free_port())))
    assert p.returncode == 2, p.stderr
    assert "refusing to serve the REST API on 0.0.0.0 with no token" in p.stderr
    assert "HSSTREAM_ALLOW_OPEN=1" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "spool").exists() and not (tmp_path / "run").exists()
    p = _hsstream("serve", env=_env(tmp_path, HSSTREAM_HOST="0.0.0.0", HSSTREAM_API_TOKEN="change-me"))
    assert p.returncode == 2 and "the placeholder token 'change-me'" in p.stderr, p.stderr


def test_serve_names_the_layouts_for_an_unknown_one_before_creating_anything(tmp_path):
    """HSSTREAM_SPOOL_LAYOUT is a name in connector/layouts/'s registry: an unknown one is one line
    naming the registered ones, exit 2, no traceback, nothing made (not a failure inside create_app)."""
    p = _hsstream("serve", env=_env(tmp_path, HSSTREAM_SPOOL_LAYOUT="arenaa", HSSTREAM_PORT=str(free_port())))
    assert p.returncode == 2, p.stderr
    assert "unknown spool layout 'arenaa' (one of files, arena)" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "spool").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_open_on_purpose_starts_with_a_loud_warning(tmp_path, how):
    port = free_port()
    env = _env(tmp_path, HSSTREAM_HOST="0.0.0.0", HSSTREAM_PORT=str(port))
    args = [sys.executable, "-m", "hsstream", "serve"]
    if how == "flag":
        args.append("--insecure-no-token")
    else:
        env["HSSTREAM_ALLOW_OPEN"] = "1"
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import httpx

        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() - t0 < 90, "the sidecar did not come up"
            time.sleep(0.3)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/jobs", timeout=5).status_code == 200  # open, as asked
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    assert "WARNING: the sidecar's REST API listens on 0.0.0.0 with no token" in err, err


def test_up_refuses_an_open_bind_before_starting_anything(tmp_path, tiny_model):
    env = _env(tmp_path, HSSTREAM_MODEL=tiny_model, HSSTREAM_HOST="0.0.0.0", HSSTREAM_PORT=str(free_port()))
    p = _hsstream("up", env=env)
    assert p.returncode == 2, p.stderr
    assert "refusing to serve the REST API on 0.0.0.0 with no token" in p.stderr
    assert "started" not in p.stderr and not (tmp_path / "spool").exists()


def test_up_open_on_purpose_says_so(tmp_path, tiny_model, monkeypatch):
    from hsstream.up import build_config

    for k in [k for k in os.environ if k.startswith("HSSTREAM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HSSTREAM_MODEL", tiny_model)
    monkeypatch.setenv("HSSTREAM_HOST", "0.0.0.0")
    monkeypatch.setenv("HSSTREAM_ALLOW_OPEN", "1")
    said: list[str] = []
    cfg = build_config(say=said.append)
    assert cfg.api_host == "0.0.0.0"
    assert any(m.startswith("WARNING: the sidecar's REST API listens on 0.0.0.0") for m in said), said


# ----------------------------------------------------------------------------- CURVE keys


def test_keys_writes_the_secret_0600_in_a_0700_folder(tmp_path):
    d = tmp_path / "keys"
    p = _hsstream("keys", str(d), "--name", "server", env=_env(tmp_path))
    assert p.returncode == 0, p.stderr
    assert _mode(d) == 0o700
    assert _mode(d / "server.key_secret") == 0o600
    assert _mode(d / "server.key") == 0o644  # the public half is for other hosts
    pub, sec = curve_keys.load_secret(d / "server.key_secret")
    assert pub and sec


def test_keys_refuses_a_folder_others_can_write(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    p = _hsstream("keys", str(d), env=_env(tmp_path))
    assert p.returncode == 2 and f"key folder {d} is writable by other users (mode 0777)" in p.stderr, p.stderr
    assert os.listdir(d) == []


@pytest.fixture
def loose_secret(tmp_path) -> Path:
    """A key pair whose secret half someone made world-readable (0644)."""
    pub, sec = curve_keys.write_key_pair(tmp_path / "keys", "server")
    os.chmod(sec, 0o644)
    return sec


def test_a_0644_secret_is_refused_on_load_with_the_fix(loose_secret):
    msg = rf"CURVE secret key file {loose_secret} is accessible to other users \(mode 0644\).*chmod 600 {loose_secret}"
    with pytest.raises(curve_keys.InsecureKeyFile, match=msg):
        curve_keys.load_secret(loose_secret)
    os.chmod(loose_secret, 0o600)
    assert curve_keys.load_secret(loose_secret)[1]


def test_sidecar_refuses_a_0644_server_secret(tmp_path, loose_secret):
    (tmp_path / "trainers").mkdir()
    env = _env(tmp_path, HSSTREAM_REMOTE_ENDPOINT=f"tcp://127.0.0.1:{free_port()}", HSSTREAM_PORT=str(free_port()),
               HSSTREAM_CURVE_SERVER_SECRET_FILE=str(loose_secret), HSSTREAM_CURVE_CLIENTS_DIR=str(tmp_path / "trainers"))  # fmt: skip
    p = _hsstream("serve", env=env)
    assert p.returncode == 2, p.stderr
    assert f"error: CURVE secret key file {loose_secret} is accessible to other users (mode 0644)" in p.stderr
    assert "Traceback" not in p.stderr


def test_trainer_refuses_a_0644_client_secret(tmp_path, loose_secret):
    from trainer_client import HiddenStateStream

    server_pub = loose_secret.with_suffix(".key")
    st = HiddenStateStream(f"tcp://127.0.0.1:{free_port()}", curve_server_key=str(server_pub),
                           curve_client_cert=str(loose_secret), timeout_s=1)  # fmt: skip
    try:
        with pytest.raises(curve_keys.InsecureKeyFile, match="chmod 600"):
            st._connect()
    finally:
        st.close()


# ----------------------------------------------------------------------------- files at rest


def test_connector_files_are_0600_whatever_safetensors_does(spool, monkeypatch):
    """safetensors 0.8 writes 0600 itself; older ones (and vLLM images pin their own) follow the
    umask: the writer makes the file 0600 before its name appears, whichever wrote it."""
    torch = pytest.importorskip("torch")
    from connector import protocol as P
    from connector.layouts import files as SW  # the files layout writes the file
    from connector.spool_writer import ShapeInfo, SpoolWriter, WriteJob

    real_save = SW.save_file

    def umask_save(tensors, path, metadata=None):  # noqa: ANN001 - as safetensors < 0.8 did
        real_save(tensors, path, metadata=metadata)
        os.chmod(path, 0o644)

    monkeypatch.setattr(SW, "save_file", umask_save)
    shape = ShapeInfo(layer_ids=[1, 2], num_hidden_layers=4, hidden_size=8, dtype="bfloat16", model="m")
    w = SpoolWriter(spool, None, shape, num_threads=1)
    names = [P.file_name_for_request(r) for r in ("cmpl-a", "cmpl-b")]
    for rid, name in zip(("cmpl-a", "cmpl-b"), names):
        w.submit(WriteJob(rid, name, None, list(range(5)), torch.zeros((5, 2, 8), dtype=torch.bfloat16)))
    assert w.flush(30)
    w.close()
    assert sorted(os.listdir(spool)) == sorted(names)
    assert [_mode(spool / f) for f in names] == [0o600, 0o600]


def test_serve_makes_spool_run_dir_and_ledger_private(tmp_path):
    from connector.contract.settings import Settings
    from server.app import create_app

    old = os.umask(0o022)
    try:
        s = Settings(spool_dir=tmp_path / "spool", run_dir=tmp_path / "run", port=free_port())
        app_ = create_app(s)
    finally:
        os.umask(old)
    try:
        assert _mode(tmp_path / "spool") == 0o700
        assert _mode(tmp_path / "run") == 0o700
        assert _mode(s.ledger_file()) == 0o600
        assert _mode(tmp_path / "run" / "api-token") == 0o600  # no HSSTREAM_API_TOKEN: the sidecar made one
    finally:
        app_.state.services.ledger.close()


# ----------------------------------------------------------------------------- deploy/


def test_compose_refuses_an_empty_token_and_keeps_vllm_on_loopback(tmp_path):
    from tests.unit.deploy.test_deploy_compose import COMPOSE, ENV_EXAMPLE, compose_cmd

    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "HSSTREAM_"))}
    text = ENV_EXAMPLE.read_text()
    empty = tmp_path / "empty.env"
    empty.write_text(text.replace("HSSTREAM_API_TOKEN=change-me", "HSSTREAM_API_TOKEN="))
    p = subprocess.run([*compose_cmd(), "--env-file", str(empty), "-f", str(COMPOSE), "config"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)  # fmt: skip
    assert p.returncode != 0 and "set HSSTREAM_API_TOKEN in deploy/.env" in p.stderr, p.stderr
    wide = tmp_path / "wide.env"
    wide.write_text(text.replace("BIND_ADDRESS=127.0.0.1", "BIND_ADDRESS=0.0.0.0"))
    for profile in ([], ["--profile", "cpu"], ["--profile", "cpu", "--profile", "live-cpu"]):
        p = subprocess.run([*compose_cmd(), "--env-file", str(wide), "-f", str(COMPOSE), *profile, "config"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)  # fmt: skip
        assert p.returncode == 0, p.stderr
        services = yaml.safe_load(p.stdout)["services"]
        for name, svc in services.items():
            for port in svc.get("ports", []):
                ip = port.get("host_ip") if isinstance(port, dict) else str(port).rsplit(":", 2)[0]
                # vLLM and the proxy in front of it answer without a key of their own: host only
                want = "127.0.0.1" if name.startswith(("vllm", "proxy")) else "0.0.0.0"
                assert ip == want, f"{name} publishes {port}"


def test_deploy_gitignore_covers_keys_and_env():
    p = subprocess.run(["git", "check-ignore", "--no-index", "deploy/.env", "deploy/keys/server.key_secret",
                        "deploy/keys/trainers/b.key"], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert p.stdout.split() == ["deploy/.env", "deploy/keys/server.key_secret", "deploy/keys/trainers/b.key"]
    p = subprocess.run(["git", "check-ignore", "--no-index", "deploy/.env.example"], cwd=ROOT, capture_output=True)
    assert p.returncode == 1  # the example stays tracked
