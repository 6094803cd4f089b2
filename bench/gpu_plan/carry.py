#!/usr/bin/env python3
"""Carry a folder to the GPU machine in parts small enough for one device call each.

The device tool carries at most 64 MiB a call (the working tree included, ~4 MiB), and the
machine forgets everything once it is given back (30 s idle): a 269 MB checkpoint goes as a
tar cut into parts of ``--part-mib`` (default 55), one part per call into ``/root/stash`` while
the machine is warm, then put together and checked there (docs/gpu-plan.md).

    python bench/gpu_plan/carry.py pack DIR .gpu/carry --name smollm2        # here: parts + manifest
    python bench/gpu_plan/carry.py unpack /root/stash smollm2 /tmp/models     # there: check, extract
    python bench/gpu_plan/carry.py calls .gpu/carry smollm2                   # the transfer calls, printed

``unpack`` prints ``STASH_INCOMPLETE`` and exits 3 when a part is missing (the machine was given
back between calls: start the transfers again), ``STASH_CORRUPT`` and exits 4 when a part's
SHA-256 differs from the manifest's; it extracts nothing then. Plain tar: a bf16 checkpoint does
not compress.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

MIB = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def pack(src: Path, dest: Path, name: str, part_mib: int) -> dict:
    """``src`` as ``dest/NAME.tar.partNN`` of at most ``part_mib`` MiB each, and
    ``dest/NAME.manifest.json`` (each part's size and SHA-256, the folder's name in the tar)."""
    if not (src / "config.json").exists() and not any(src.iterdir()):
        raise SystemExit(f"carry: {src} is empty")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{name}.tar.part*"):
        old.unlink()
    tar = dest / f"{name}.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname=name)
    parts = []
    with open(tar, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_mib * MIB), b"")):
            p = dest / f"{name}.tar.part{i:02d}"
            p.write_bytes(block)
            parts.append({"file": p.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"name": name, "tar_bytes": tar.stat().st_size, "tar_sha256": sha256(tar), "part_mib": part_mib,
                "parts": parts}  # fmt: skip
    tar.unlink()
    (dest / f"{name}.manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(stash: Path, name: str, out: Path) -> Path:
    """Check every part of ``NAME`` in ``stash`` against its manifest, put the tar together and
    extract it under ``out``; returns ``out/NAME``."""
    mf = stash / f"{name}.manifest.json"
    if not mf.exists():
        print(f"STASH_INCOMPLETE: no {mf.name} in {stash}")
        raise SystemExit(3)
    manifest = json.loads(mf.read_text())
    missing = [p["file"] for p in manifest["parts"] if not (stash / p["file"]).exists()]
    if missing:
        print(f"STASH_INCOMPLETE: missing {', '.join(missing)} in {stash}")
        raise SystemExit(3)
    bad = [p["file"] for p in manifest["parts"] if sha256(stash / p["file"]) != p["sha256"]]
    if bad:
        print(f"STASH_CORRUPT: {', '.join(bad)} differ from the manifest")
        raise SystemExit(4)
    out.mkdir(parents=True, exist_ok=True)
    tar = out / f"{name}.tar"
    with open(tar, "wb") as w:
        for p in manifest["parts"]:
            with open(stash / p["file"], "rb") as r:
                shutil.copyfileobj(r, w, 8 * MIB)
    if sha256(tar) != manifest["tar_sha256"]:
        print("STASH_CORRUPT: the parts put together differ from the packed tar")
        raise SystemExit(4)
    with tarfile.open(tar) as t:
        members = t.getmembers()
        if any(Path(m.name).is_absolute() or ".." in Path(m.name).parts or not (m.isfile() or m.isdir()) for m in members):
            raise SystemExit("carry: the tar holds a path outside its folder or a link: refused")
        t.extractall(out, members=members)
    tar.unlink()
    return out / name


def calls(dest: Path, name: str, repo_dir: str = ".gpu/carry") -> list[dict]:
    """One device call per part: ``carry`` that part (and, with the first, the manifest), the
    command copying it into /root/stash. Calls must follow each other within the machine's 30 s."""
    manifest = json.loads((dest / f"{name}.manifest.json").read_text())
    out = []
    for i, p in enumerate(manifest["parts"]):
        carry = [f"{repo_dir}/{p['file']}"] + ([f"{repo_dir}/{name}.manifest.json"] if i == 0 else [])
        out.append({"carry": carry, "timeout_s": 120,
                    "command": f"mkdir -p /root/stash && cp {' '.join(carry)} /root/stash/ && ls -la /root/stash"})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack")
    p.add_argument("src", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--part-mib", type=int, default=55, help="at most 64 MiB a call, the ~4 MiB working tree included")
    u = sub.add_parser("unpack")
    u.add_argument("stash", type=Path)
    u.add_argument("name")
    u.add_argument("out", type=Path)
    c = sub.add_parser("calls")
    c.add_argument("dest", type=Path)
    c.add_argument("name")
    a = ap.parse_args(argv)
    if a.verb == "pack":
        if a.part_mib < 1 or a.part_mib > 59:
            ap.error("--part-mib: 1..59 (a call carries at most 64 MiB, the working tree included)")
        m = pack(a.src, a.dest, a.name, a.part_mib)
        print(f"{len(m['parts'])} parts of at most {a.part_mib} MiB in {a.dest} ({m['tar_bytes'] / MIB:.1f} MiB)")
    elif a.verb == "unpack":
        print(f"unpacked {unpack(a.stash, a.name, a.out)}")
    else:
        print(json.dumps(calls(a.dest, a.name), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
