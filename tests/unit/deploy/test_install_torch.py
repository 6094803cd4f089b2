"""deploy/install_torch.py against stand-in package indexes on 127.0.0.1.

PyTorch's CPU index cannot be reached from our machines, so its fallback is tested with a
stand-in: pip's own configuration is switched off (no find-links folder, no config files), the
"configured source" is an index on 127.0.0.1 that has no torch (as PyPI has no ``+cpu`` build),
and the fallback is pointed at a second index that holds the CPU wheel. A fake wheel of the
same name stands in where the machine has no real one.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "deploy" / "install_torch.py"
sys.path.insert(0, str(SCRIPT.parent))
import install_torch  # noqa: E402

sys.path.pop(0)


def _real_wheel() -> Path | None:
    """The CPU wheel from pip's find-links folders, if this machine has one (ours do)."""
    spec = install_torch.wanted_spec().split("==")[1]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders += [line.split("=", 1)[1].strip("'\" ") for line in out.splitlines() if "find-links" in line]
    for folder in folders:
        for whl in Path(folder).glob(f"torch-{spec}-{tag}-*.whl"):
            return whl
    return None


def _fake_wheel(folder: Path) -> Path:
    version = install_torch.wanted_spec().split("==")[1]
    whl = folder / f"torch-{version}-py3-none-any.whl"
    dist = f"torch-{version}.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("torch/__init__.py", "")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return whl


@contextlib.contextmanager
def _index_server(root: Path, whl: Path):
    """Two PEP 503 indexes on one stand-in server: /empty/ (no torch) and /cpu/ (holding ``whl``)."""
    (root / "empty").mkdir()
    (root / "empty" / "index.html").write_text("<html><body></body></html>")
    pkg = root / "cpu" / "torch"
    pkg.mkdir(parents=True)
    (pkg / whl.name).symlink_to(whl)
    (pkg / "index.html").write_text(f'<html><body><a href="{whl.name.replace("+", "%2B")}">{whl.name}</a></body></html>')
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """The stand-in indexes with torch's real CPU wheel where this machine has one."""
    root = tmp_path_factory.mktemp("index")
    whl = _real_wheel() or _fake_wheel(root)
    with _index_server(root, whl) as base:
        yield base, whl


@pytest.fixture(scope="module")
def small_indexes(tmp_path_factory):
    """The same with a small stand-in wheel (the hash checks need no 200 MB download)."""
    root = tmp_path_factory.mktemp("small-index")
    whl = _fake_wheel(root)
    with _index_server(root, whl) as base:
        yield base, whl


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a: object) -> None:
        pass


def _stock_env(configured_index: str) -> dict:
    """A machine without our pip setup: no config files, no find-links; one configured index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=configured_index, PIP_NO_CACHE_DIR="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", TORCH_CPU_INDEX_URL="")
    return env


def _run(env: dict, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], env=env, capture_output=True, text=True,
                       timeout=300)
    return p, time.monotonic() - t


def test_torch_comes_from_the_cpu_index_when_the_configured_sources_lack_it(indexes):
    base, whl = indexes
    p, _ = _run(_stock_env(f"{base}/empty/"), "--index", f"{base}/cpu/")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"from {base}/cpu/" in p.stdout, p.stdout
    assert f"{base}/cpu/torch/{whl.name.replace('+', '%2B')}" in p.stdout, p.stdout


def test_the_configured_sources_win_when_they_have_it(indexes, tmp_path):
    base, _ = indexes
    _fake_wheel(tmp_path)  # a find-links folder (the real wheel is tried through the index above)
    env = {**_stock_env(f"{base}/empty/"), "PIP_FIND_LINKS": str(tmp_path)}
    p, _ = _run(env, "--index", "http://127.0.0.1:9/never-asked/")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "from pip's configured sources" in p.stdout and str(tmp_path) in p.stdout, p.stdout


def test_an_unreachable_cpu_index_fails_fast_with_one_clear_line(indexes):
    base, _ = indexes
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/simple/"
    p, took = _run(_stock_env(f"{base}/empty/"), "--index", dead)
    assert p.returncode == 3, p.stdout + p.stderr
    first = p.stderr.splitlines()[0]
    assert first.startswith("install_torch: torch==") and dead in first and "TORCH_CPU_INDEX_URL" in first, p.stderr
    assert took < 90, f"took {took:.0f} s"


def test_the_makefile_and_the_cpu_image_install_torch_through_the_script():
    make = (ROOT / "Makefile").read_text()
    docker = (ROOT / "deploy" / "Dockerfile.cpu").read_text()
    assert "deploy/install_torch.py" in make and "install_torch.py" in docker
    assert "pip install -q --disable-pip-version-check torch==" not in make
    assert "download.pytorch.org" not in make


def _lock_for(path: Path, whl: Path, sha: str) -> Path:
    version = install_torch.wanted_spec().split("==")[1]
    path.write_text(f"# a lock\nfilelock==3.12.0 \\\n    --hash=sha256:{'0' * 64}\ntorch=={version} \\\n"
                    f"    --hash=sha256:{sha}\n    # via x\n")
    return path


def test_with_the_lock_the_wheel_must_have_the_locked_hash(small_indexes, tmp_path):
    """``--lock``: the CPU index's wheel is taken only if its sha256 is the lock's (a stock
    machine's install path: here against a stand-in index, PyTorch's cannot be reached)."""
    import hashlib

    base, whl = small_indexes
    sha = hashlib.sha256(whl.read_bytes()).hexdigest()
    assert install_torch.locked_torch(str(_lock_for(tmp_path / "good.txt", whl, sha)))[1] == [sha]
    p, _ = _run(_stock_env(f"{base}/empty/"), "--index", f"{base}/cpu/", "--lock", str(tmp_path / "good.txt"))
    assert p.returncode == 0 and f"from {base}/cpu/" in p.stdout, p.stdout + p.stderr
    p, _ = _run(_stock_env(f"{base}/empty/"), "--index", f"{base}/cpu/", "--lock",
                str(_lock_for(tmp_path / "bad.txt", whl, "f" * 64)))  # fmt: skip
    assert p.returncode == 4, p.stdout + p.stderr
    first = p.stderr.splitlines()[0]
    assert "is not the file the lock names" in first and "f" * 64 in first, p.stderr


def test_a_lock_without_torch_is_one_clear_error(tmp_path):
    lock = tmp_path / "l.txt"
    lock.write_text("numpy==2.0 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(SystemExit, match="pins no torch with a hash"):
        install_torch.locked_torch(str(lock))
