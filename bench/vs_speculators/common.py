"""What both arms share: the clock, pinned child processes, and the disk / /dev/shm sampler."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common.disk_peaks import PeakSampler, tree_bytes

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), "[vs-speculators]", *a, file=sys.stderr, flush=True)


class Sampler(PeakSampler):
    """Polls every ``period_s``: bytes under each disk directory of an arm, and everything in
    /dev/shm above what was there when it started; keeps each peak and the time series."""

    def __init__(self, disk: dict[str, Path], period_s: float = 0.5) -> None:
        super().__init__(disk, period_s)
        self.peak_shm = 0
        self.series: list[tuple[float, int, int]] = []  # (t, disk bytes, shm bytes above baseline)
        self._base = tree_bytes(SHM)
        self._t0 = time.time()

    @property
    def peak_disk(self) -> int:
        return self.peak_sum

    def sample(self) -> dict[str, int]:
        now = super().sample()
        d = sum(now.values())
        s = max(0, tree_bytes(SHM) - self._base)
        self.peak_shm = max(self.peak_shm, s)
        if len(self.series) < 4000:
            self.series.append((round(time.time() - self._t0, 1), d, s))
        return now

    def result(self) -> dict:
        return {"disk_peak_bytes": {**self.peak, "total": self.peak_disk}, "shm_peak_bytes": self.peak_shm,
                "shm_baseline_bytes": self._base, "samples": len(self.series)}  # fmt: skip


def pinned_env(cores: list[int] | None, extra: dict | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1", **(extra or {})}  # fmt: skip
    if cores is not None:
        env["OMP_NUM_THREADS"] = str(len(cores))
    return env


def spawn_pinned(cmd: list[str], cores: list[int] | None, log_path: Path, env: dict | None = None,
                 cwd: Path = ROOT) -> subprocess.Popen:  # fmt: skip
    """``cmd`` as a child on ``cores`` (its affinity set before it runs, inherited by its own
    children), stdout and stderr to ``log_path``."""
    fh = open(log_path, "ab")  # noqa: SIM115 - closed with the process (see finish)
    pre = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env or pinned_env(cores), cwd=str(cwd),
                         preexec_fn=pre, start_new_session=True)  # fmt: skip
    p._log_fh = fh  # type: ignore[attr-defined]
    return p


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children reaped so far."""
    import resource

    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def finish_cpu(p: subprocess.Popen, timeout: float | None = None) -> tuple[int, float]:
    """:func:`finish`, and the CPU seconds the child used: what its work costs on a core of its
    own, whatever else the machine ran meanwhile (the rates a loaded machine can still measure).
    Only ``p`` may be reaped meanwhile (both arms' other children outlive their trainer)."""
    before = children_cpu_s()
    code = finish(p, timeout)
    return code, round(children_cpu_s() - before, 2)


def finish(p: subprocess.Popen, timeout: float | None = None) -> int:
    try:
        return p.wait(timeout)
    finally:
        fh = getattr(p, "_log_fh", None)
        if fh is not None and p.returncode is not None:
            fh.close()


def stop(p: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the child's process group, SIGKILL after ``grace_s``."""
    import signal

    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
    finish(p, 0)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Until ``url`` answers 200; raises with the log's tail if ``proc`` exits first or time runs out."""
    import httpx

    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited ({proc.returncode}) before it was ready:\n{tail(log_path)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s:\n{tail(log_path)}")
