"""The wheel users install (issue 21): ``pip wheel --no-deps .`` builds, and what it holds runs
without the repository.

The wheel is built from a copy of the clone's files (tracked and untracked, not ignored: never a
stale ``build/``, and nothing written into the clone), installed with ``--no-deps`` into a fresh
venv that reuses this venv's third-party packages through a ``.pth`` (a folder of links to them,
leaving out this project's editable install), and run from an empty folder with ``PYTHONPATH``
unset: ``hsstream --help``, ``hsstream serve --help`` and an import of every module of every
package, each of which must come from the new venv. The packages are found by walking the
clone, so a new package or module is covered without editing this file; one that is not meant
for the wheel is listed in NOT_SHIPPED with the reason.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DIST = "hidden_state_stream"
#: Top-level packages of the clone that the wheel leaves out, and why.
NOT_SHIPPED = {
    "tests": "the test suite: run from a clone",
    "bench": "benchmarks: run from a clone, writing bench/results/",
}
#: Not files of the project: build and cache outputs.
JUNK = ("__pycache__", ".pyc")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    # Never the checkout on the path (PYTHONPATH=$PWD, as the drift runs and helpers use): pip would
    # see its egg-info as the project already installed and skip the wheel.
    kw.setdefault("env", {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")})
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{shlex.join(cmd)[:300]} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def clone_files() -> list[Path]:
    """The clone's files as git sees them (tracked, and untracked but not ignored), else all."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout  # fmt: skip
        rels = [Path(p) for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "dist", ".demo", ".pytest_cache"}
        rels = [p.relative_to(ROOT) for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]
    return [r for r in rels if (ROOT / r).is_file() and not any(j in str(r) for j in JUNK)]


def shipped_packages() -> list[str]:
    """Every top-level package of the clone but those in NOT_SHIPPED."""
    pkgs = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert set(NOT_SHIPPED) <= set(pkgs), f"NOT_SHIPPED names packages that are gone: {set(NOT_SHIPPED) - set(pkgs)}"
    return [p for p in pkgs if p not in NOT_SHIPPED]


def modules_of(src: Path, packages: list[str]) -> list[str]:
    """Every importable module and package under ``packages`` (``__main__`` runs, not imported)."""
    mods = []
    for pkg in packages:
        for f in sorted((src / pkg).rglob("*.py")):
            parts = f.relative_to(src).with_suffix("").parts
            if not all((src / Path(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
                continue  # a folder of scripts inside a package, not a sub-package
            if parts[-1] == "__main__":
                continue
            mods.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return mods


def venv_with_our_dependencies(venv: Path, links: Path) -> Path:
    """A new venv whose ``.pth`` adds ``links``: a link to each entry of this venv's
    site-packages but this project's own (its editable install's finder, ``.pth`` and
    dist-info, any installed copy of its packages), so only the wheel can provide those."""
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    ours = set(shipped_packages())
    links.mkdir()
    for sp in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for e in Path(sp).iterdir():
            if (e.name.startswith("__editable__") or e.suffix == ".pth" or e.name in ours or e.name == "__pycache__"
                    or e.name.lower().startswith(DIST + "-")):  # fmt: skip
                continue
            if not (links / e.name).exists():
                (links / e.name).symlink_to(e)
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "_hsstream_test_deps.pth").write_text(f"{links}\n")
    return py


def test_wheel_builds_installs_and_runs_without_the_repository(tmp_path):
    t0 = time.perf_counter()
    src, wheels, cwd = tmp_path / "src", tmp_path / "wheels", tmp_path / "elsewhere"
    files = clone_files()
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--disable-pip-version-check", "-w", str(wheels), str(src)], cwd=tmp_path)  # fmt: skip
    (wheel,) = wheels.glob(f"{DIST}-*.whl")
    t_build = time.perf_counter() - t0

    # Every file of every shipped package is in the wheel (package data too), and nothing else.
    packages = shipped_packages()
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {r.as_posix() for r in files if r.parts[0] in packages}
    assert not expected - names, f"files of the packages missing from the wheel: {sorted(expected - names)}"
    tops = {n.split("/")[0] for n in names}
    stray = {t for t in tops if t not in packages and not t.endswith((".dist-info", ".data"))}
    assert not stray, f"the wheel holds more than the packages {packages}: {sorted(stray)}"

    venv = tmp_path / "venv"
    py = venv_with_our_dependencies(venv, tmp_path / "deps")
    run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "-q",
         "--disable-pip-version-check", str(wheel)], cwd=tmp_path)  # fmt: skip

    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    hs = venv / "bin" / "hsstream"
    assert hs.is_file(), "the wheel's console script is not installed"
    assert "serve" in run([str(hs), "--help"], cwd=cwd, env=env).stdout
    assert "Run the sidecar" in run([str(hs), "serve", "--help"], cwd=cwd, env=env).stdout
    modules = modules_of(src, packages)
    assert {"connector.vllm_plugin", "server.app", "trainer_client.eagle3", "hsstream.cli"} <= set(modules)
    code = ("import importlib, json, sys; "
            "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))")  # fmt: skip
    out = run([str(py), "-c", code, *modules], cwd=cwd, env=env).stdout
    where = json.loads(out[out.index("{") :])
    site = venv.resolve()
    outside = {m: f for m, f in where.items() if not Path(f).resolve().is_relative_to(site)}
    assert not outside, f"imported from outside the new venv: {outside}"
    print(f"wheel built in {t_build:.1f} s; {len(modules)} modules of {packages} imported from it; "
          f"{time.perf_counter() - t0:.1f} s in all")
