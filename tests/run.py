"""``make test``: the tests in two lanes side by side, each in its own /dev/shm.

Why side by side: the integration tests that start vLLM engines (with sidecars and trainer
processes) spend much of their time in one process importing vLLM or torch, or waiting on a restart
or a timeout, while the host's other core idles. The rest — the unit suite (tests/unit/, ~5.5 min
alone on the 2-core host, nearly all of it one core) and the integration modules that start no vLLM
(a real sidecar, uvicorn, ZeroMQ; tests/support/vllm_starts.py tells them apart) — fits into that
idle time, at a lower priority (``nice``) so the engines' lane, the longer, keeps its pace.

Why each in its own /dev/shm: both suites' guards (tests/conftest.py: no hidden-state file, no spool
directory and no orphaned semaphore left behind) look at the whole of /dev/shm, so a lane would
count the other's files as its own leaks. The side lane therefore runs in a mount namespace of its
own with a fresh tmpfs on /dev/shm (``unshare --mount``, which needs root or CAP_SYS_ADMIN); it
never needs what other processes put there. Where that namespace cannot be made (no ``unshare``, a
container without the capability), the two suites run one after the other, as ``pytest tests``
runs them; the runner says which it did.

Arguments are passed to both pytest runs. The engines' lane's output streams as it runs; the side
lane's is kept in a file and printed whole when both are done (one line when it ends). The exit
status is the worse of the two. Every test module is in exactly one lane. ``pytest tests`` still
runs everything in one process.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT, INTEGRATION = "tests/unit", "tests/integration"
#: The side lane's priority beside the engines' lane (the longer: keep its pace).
SIDE_NICE = 10
#: The private /dev/shm: tmpfs's own default size (half of RAM), world-writable with the sticky bit as /dev/shm is.
SHM_OPTIONS = "size=50%,mode=1777"


def private_shm_prefix() -> list[str] | None:
    """The command prefix that runs a command with a fresh, private tmpfs on /dev/shm, or None
    where this host cannot make one (checked by making one: a missing ``unshare``, no root, or a
    container without CAP_SYS_ADMIN all fail here, not in the middle of a run)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "--mount", "--propagation", "private", "--", "sh", "-c",
              f'mount -t tmpfs -o {SHM_OPTIONS} hsstream-test-shm /dev/shm && exec "$@"', "sh"]  # fmt: skip
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if probe.returncode == 0 else None


def combined_status(*codes: int) -> int:
    """The worse of pytest's exit statuses: a failure or an error over "no tests collected" (5)
    over success (0)."""
    bad = [c for c in codes if c not in (0, 5)]
    if bad:
        return max(bad)
    return 5 if codes and all(c == 5 for c in codes) else 0


def pytest_cmd(suite: str | list[str], args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *([suite] if isinstance(suite, str) else suite), *args]


def lanes(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(the side lane's pytest paths, the engines' lane's): the unit suite and the integration
    modules that start no vLLM, then the integration folder without those."""
    from tests.support.vllm_starts import starts_vllm

    quiet = sorted(str(p.relative_to(root)) for p in (root / INTEGRATION).rglob("test_*.py") if not starts_vllm(p))
    return [UNIT, *quiet], [INTEGRATION, *(f"--ignore={q}" for q in quiet)]


def run_side_by_side(side: list[str], engines: list[str], *, out=sys.stdout) -> int:
    """Run ``side`` (the side lane's command: output to a file, printed at the end) beside
    ``engines`` (the engines' lane's: output streamed); Ctrl-C and SIGTERM reach both. Returns the
    combined exit status."""
    log_dir = Path(tempfile.mkdtemp(prefix="hsstream-side-lane-"))
    log = log_dir / "side.txt"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        u = subprocess.Popen(side, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    i = subprocess.Popen(engines, cwd=ROOT)
    procs = (u, i)

    def forward(signum, _frame):  # noqa: ANN001
        # Ctrl-C reaches both from the terminal (they share its process group): only wait for them.
        # A SIGTERM sent to this process alone is passed on.
        if signum != signal.SIGINT:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        done: dict[int, int] = {}
        while len(done) < 2:
            for p in procs:
                if p.pid not in done and (rc := p.poll()) is not None:
                    done[p.pid] = rc
                    if p is u:
                        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                        print(f"\n[make test] side lane ended after {time.monotonic() - t0:.0f} s, exit {rc}: "
                              f"{tail[0]} (its whole output follows the other lane's)",
                              file=out, flush=True)  # fmt: skip
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print("\n[make test] ---- the side lane's output (unit + integration without vLLM) ----", file=out)
    print(log.read_text(errors="replace"), file=out, flush=True)
    shutil.rmtree(log_dir, ignore_errors=True)
    status = combined_status(done[u.pid], done[i.pid])
    print(f"[make test] side lane exit {done[u.pid]}, engines' lane exit {done[i.pid]}, "
          f"{time.monotonic() - t0:.0f} s in all", file=out, flush=True)  # fmt: skip
    return status


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    prefix = private_shm_prefix()
    if prefix is None:
        print("[make test] no private /dev/shm can be made here (unshare --mount needs root or CAP_SYS_ADMIN): "
              "the suites run one after the other", flush=True)  # fmt: skip
        return subprocess.call(pytest_cmd("tests", args), cwd=ROOT)
    print("[make test] the unit suite and the integration modules that start no vLLM run beside those that "
          "do, in a /dev/shm of their own (tests/run.py says why)", flush=True)  # fmt: skip
    side, engines = lanes()
    return run_side_by_side([*prefix, "nice", "-n", str(SIDE_NICE), *pytest_cmd(side, args)], pytest_cmd(engines, args))


if __name__ == "__main__":
    sys.exit(main())
