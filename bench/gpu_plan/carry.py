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


def part_sizes(spec: str) -> list[float]:
    """``--part-mib``: one size, or a comma-separated list whose last size repeats (e.g.
    ``13.6,13.6,13.6,57.9``: three parts small enough to ride with a 44.3 MiB bundle part, then
    parts that fill a call alone)."""
    try:
        sizes = [float(x) for x in spec.split(",")]
    except ValueError:
        raise SystemExit(f"carry: --part-mib {spec!r}: sizes in MiB, comma-separated") from None
    if not sizes or any(x < 1 or x > 59 for x in sizes):
        raise SystemExit("carry: --part-mib: each 1..59 (a call carries at most 64 MiB, the working tree included)")
    return sizes


def compress_xz(tar: Path) -> Path:
    """``tar`` as ``tar.xz`` (xz -0, on every core where the xz tool is there, else Python's lzma):
    a bf16 checkpoint loses about a third, which is a device call fewer. Preset 0: a checkpoint's
    gain is in the entropy coding, not in matches, so higher presets only cost time. ``unpack``
    reads either."""
    out = tar.with_name(tar.name + ".xz")
    if shutil.which("xz"):
        import subprocess

        with open(out, "wb") as w:
            subprocess.run(["xz", "-0", "-T0", "-c", str(tar)], stdout=w, check=True)
    else:
        import lzma

        with open(tar, "rb") as r, lzma.open(out, "wb", preset=0) as w:
            shutil.copyfileobj(r, w, 8 * MIB)
    tar.unlink()
    return out


def pack(src: Path, dest: Path, name: str, part_mib: str | float, compress: str = "none") -> dict:
    """``src`` as ``dest/NAME.tar.partNN`` (``--part-mib``: each part's size, :func:`part_sizes`),
    and ``dest/NAME.manifest.json`` (each part's size and SHA-256, the folder's name in the tar).
    ``compress`` xz: the tar is compressed before it is cut."""
    if not (src / "config.json").exists() and not any(src.iterdir()):
        raise SystemExit(f"carry: {src} is empty")
    sizes = part_sizes(str(part_mib))
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{name}.tar.part*"):
        old.unlink()
    tar = dest / f"{name}.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname=name)
    if compress == "xz":
        tar = compress_xz(tar)
    parts = []
    with open(tar, "rb") as f:
        i = 0
        while block := f.read(int(sizes[min(i, len(sizes) - 1)] * MIB)):
            p = dest / f"{name}.tar.part{i:02d}"
            p.write_bytes(block)
            parts.append({"file": p.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
            i += 1
    manifest = {"name": name, "tar_bytes": tar.stat().st_size, "tar_sha256": sha256(tar), "part_mib": str(part_mib),
                "compress": compress, "parts": parts}  # fmt: skip
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
    tar = out / (f"{name}.tar.xz" if manifest.get("compress") == "xz" else f"{name}.tar")
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
    p.add_argument("--part-mib", default="55",
                   help="MiB a part, or a comma-separated list whose last size repeats; at most 64 MiB a call, "
                        "the ~5 MiB working tree included")
    p.add_argument("--compress", choices=("none", "xz"), default="none", help="xz: compress the tar before it is cut")
    u = sub.add_parser("unpack")
    u.add_argument("stash", type=Path)
    u.add_argument("name")
    u.add_argument("out", type=Path)
    c = sub.add_parser("calls")
    c.add_argument("dest", type=Path)
    c.add_argument("name")
    a = ap.parse_args(argv)
    if a.verb == "pack":
        m = pack(a.src, a.dest, a.name, a.part_mib, a.compress)
        print(f"{len(m['parts'])} parts ({a.part_mib} MiB) in {a.dest} ({m['tar_bytes'] / MIB:.1f} MiB)")
    elif a.verb == "unpack":
        print(f"unpacked {unpack(a.stash, a.name, a.out)}")
    else:
        print(json.dumps(calls(a.dest, a.name), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
