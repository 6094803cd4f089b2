#!/usr/bin/env python3
"""Soak: many short samples through vLLM (CPU), the sidecar and ``HiddenStateStream``, with a
trainer killed and restarted and the sidecar killed and restarted on the way.

Every few seconds it samples each process's RSS and open fds, the ledger's size on disk and
the spool's file count; at the end it checks that every sample was acked exactly once, that no
process grew (RSS and fds between 20 % and 100 % of its own run grow < 10 %) and that the spool
is empty. Writes bench/results/soak_cpu.json and .png (``make soak``; not part of CI).

    python bench/long_checks/soak.py                       # 20,000 samples of 32-64 tokens
    python bench/long_checks/soak.py --samples 2000        # a short run, labelled as such in the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.common import rank_value  # noqa: E402


# ----------------------------------------------------------------------------------- trainer
def trainer(endpoint: str, spool: str, log: str) -> int:
    """The trainer process: consume every job, ack each sample once used, log each ack."""
    from trainer_client import HiddenStateStream

    out = open(log, "a", buffering=1)  # noqa: SIM115
    with HiddenStateStream(endpoint, spool_dir=spool, ack="manual", credit=16, timeout_s=600, heartbeat_s=0.5) as s:
        for smp in s:
            s.ack_through(smp.key)
            out.write(f"{smp.key}\n")
    out.write("END\n")
    return 0


# ----------------------------------------------------------------------------------- driver
def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _usage(pid: int) -> tuple[int, int] | None:
    """RSS and open fds of a process and its children (vLLM's engine runs in a child)."""
    rss = fds = 0
    try:
        for p in _tree(psutil.Process(pid)):
            rss += p.memory_info().rss
            fds += p.num_fds()
    except psutil.NoSuchProcess:
        return None
    return rss, fds


def growth(points: list[dict], key: str) -> dict:
    """Growth of ``key`` between 20 % and 100 % of one process's run: median of the samples in
    the 20-30 % window against the median of the last 10 %, so one noisy sample decides nothing."""
    if len(points) < 10:
        return {"samples": len(points), "growth": None, "note": "too few samples to judge"}
    t0, t1 = points[0]["t"], points[-1]["t"]

    def med(lo: float, hi: float) -> float:
        return rank_value([p[key] for p in points if t0 + lo * (t1 - t0) <= p["t"] <= t0 + hi * (t1 - t0)], 0.5)

    a, b = med(0.2, 0.3), med(0.9, 1.0)
    return {"samples": len(points), "at_20pct": a, "at_end": b, "growth": round((b - a) / a, 4) if a else None}


def processes(series: list[dict]) -> dict:
    """Each process's RSS and fds growth (:func:`growth`), per pid: a restarted process is judged
    on its own run, not against the one it replaced."""
    procs = {}
    for name in ("vllm", "sidecar", "trainer"):
        for pid in dict.fromkeys(p[f"{name}_pid"] for p in series if f"{name}_pid" in p):
            pts = [p for p in series if p.get(f"{name}_pid") == pid]
            procs[f"{name}[{pid}]"] = {
                "from_s": pts[0]["t"], "to_s": pts[-1]["t"],
                "rss": growth([{"t": p["t"], "v": p[f"{name}_rss"]} for p in pts], "v"),
                "fds": growth([{"t": p["t"], "v": p[f"{name}_fds"]} for p in pts], "v"),
            }  # fmt: skip
    return procs


def verdict(expected: set[str], acked: list[str], series: list[dict], events: list[dict], *, consumed: int,
            failed: int, left: list[str], ok: bool) -> dict:
    """The soak's checks from what it recorded: ``acked`` (every line the trainers logged, one per
    ACK), the measurement ``series``, the ``events``, the ledger's final counts and the spool files
    ``left``; ``ok``: every job ended. Pure, so that a unit test holds it (and re-derives the
    committed result's checks from its own series and events)."""
    dupes = len(acked) - len(set(acked))
    missing = len(expected - set(acked))
    procs = processes(series)
    judged = [g for v in procs.values() for g in (v["rss"], v["fds"]) if g["growth"] is not None]
    checks = {
        "all_acked_exactly_once": ok and dupes == 0 and missing == 0 and consumed == len(expected) and failed == 0,
        "no_process_grew_10pct": bool(judged) and all(g["growth"] < 0.10 for g in judged),
        "spool_empty_at_end": ok and not left,
        "trainer_restarted": any("trainer killed" in e["event"] for e in events),
        "sidecar_restarted": any(e["event"] == "sidecar back" for e in events),
    }
    return {"acked_twice": dupes, "never_acked": missing, "processes": procs, "checks": checks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--jobs", type=int, default=20, help="the samples are split over this many jobs")
    ap.add_argument("--min-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between measurements")
    ap.add_argument("--budget-bytes", type=int, default=8 * 2**20, help="spool budget (small: the throttle works)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak_cpu"))
    ap.add_argument("--trainer", nargs=3, metavar=("ENDPOINT", "SPOOL", "LOG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer:
        return trainer(*args.trainer)

    from connector.contract.rest_client import SidecarError
    from hsstream import launch
    from hsstream.devstack import Stack
    from hsstream.tiny_model import build_tiny_verifier

    model = str(build_tiny_verifier())
    work = Path(tempfile.mkdtemp(prefix="hsstream-soak-"))
    ledger = work / "ledger.sqlite"
    stack = Stack(model, [2, 6, 9, 12], work)
    api = None  # made once the stack is up: its sidecar writes the token the client reads
    stack.env.update({"HSSTREAM_LEDGER_PATH": str(ledger), "HSSTREAM_SPOOL_BUDGET_BYTES": str(args.budget_bytes),
                      "HSSTREAM_TRAINER_TIMEOUT_S": "10"})  # fmt: skip
    rng = random.Random(0)
    series: list[dict] = []
    events: list[dict] = []
    trainer_logs: list[Path] = []
    trainers: list[subprocess.Popen] = []
    t_start = time.time()

    def event(what: str) -> None:
        events.append({"t": round(time.time() - t_start, 2), "event": what})
        print(f"[{time.time() - t_start:7.1f} s] {what}", flush=True)

    def start_trainer() -> subprocess.Popen:
        log = work / f"trainer{len(trainer_logs)}.log"
        trainer_logs.append(log)
        cmd = [sys.executable, __file__, "--trainer", stack.delivery_endpoint, str(stack.spool), str(log)]
        p = subprocess.Popen(cmd, env=launch.child_env(), cwd=launch.repo_root(), start_new_session=True)
        trainers.append(p)
        return p

    def child(name: str):  # noqa: ANN202
        return next(c for c in stack.children if c.name == name)

    def restart_sidecar() -> None:
        c = child("sidecar")
        os.killpg(c.proc.pid, signal.SIGKILL)
        c.proc.wait(30)
        new = launch.spawn("sidecar", list(c.proc.args), launch.child_env(stack.env), c.log_path, launch.repo_root())
        stack.children[stack.children.index(c)] = new
        launch.wait_http(f"{stack.api}/healthz", new, 120)

    def progress() -> tuple[int, int, int]:
        try:
            js = api.jobs()
        except SidecarError:
            return -1, -1, -1  # the sidecar is restarting
        c = [j.counts for j in js]
        return sum(x["consumed"] for x in c), sum(x["failed"] for x in c), sum(j.done for j in js)

    expected: set[str] = set()
    ok, left, consumed, failed = False, [], -1, -1
    try:
        event("starting vLLM and the sidecar")
        stack.start()
        api = stack.client(timeout=120)
        event("stack up; submitting")
        per_job = args.samples // args.jobs
        for j in range(args.jobs):
            n = per_job if j < args.jobs - 1 else args.samples - per_job * (args.jobs - 1)
            lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(n)]
            samples = [{"token_ids": [rng.randrange(0, 509) for _ in range(k)]} for k in lengths]
            job = api.create_job(samples).job_id
            expected.update(f"{job}/0/{i}" for i in range(n))
        event(f"{len(expected)} samples in {args.jobs} jobs submitted")
        start_trainer()
        restarted_trainer = restarted_sidecar = False
        done_at = None
        while time.time() - t_start < args.timeout:
            consumed, failed, jobs_done = progress()
            point = {"t": round(time.time() - t_start, 2), "consumed": consumed, "failed": failed,
                     "spool_files": len(stack.spool_files()),
                     "ledger_bytes": sum(f.stat().st_size for f in work.glob("ledger.sqlite*"))}  # fmt: skip
            for name, pid in (("vllm", child("vllm").proc.pid), ("sidecar", child("sidecar").proc.pid),
                              ("trainer", trainers[-1].pid)):  # fmt: skip
                u = _usage(pid)
                if u is not None:
                    point[f"{name}_pid"], point[f"{name}_rss"], point[f"{name}_fds"] = pid, u[0], u[1]
            series.append(point)
            if consumed >= 0.3 * args.samples and not restarted_trainer:
                trainers[-1].send_signal(signal.SIGKILL)
                trainers[-1].wait(30)
                event(f"trainer killed (SIGKILL) at {consumed} consumed; starting another")
                start_trainer()
                restarted_trainer = True
            elif consumed >= 0.6 * args.samples and not restarted_sidecar:
                event(f"sidecar killed (SIGKILL) at {consumed} consumed; restarting it")
                restart_sidecar()
                event("sidecar back")
                restarted_sidecar = True
            if jobs_done == args.jobs and trainers[-1].poll() is not None:
                done_at = time.time() - t_start
                event(f"all jobs done, trainer exited ({trainers[-1].returncode})")
                break
            time.sleep(args.interval)
        time.sleep(1.0)
        left = stack.spool_files()
        consumed, failed, _ = progress()
        ok = done_at is not None
    finally:
        for p in trainers:
            if p.poll() is None:
                p.kill()
        if api is not None:
            api.close()
        stack.stop()
        stack.remove_spool()

    # ----------------------------------------------------------------------------- verdict
    acked: list[str] = [ln for log in trainer_logs if log.exists() for ln in log.read_text().split() if ln != "END"]
    v = verdict(expected, acked, series, events, consumed=consumed, failed=failed, left=left, ok=ok)
    dupes, missing, procs, checks = v["acked_twice"], v["never_acked"], v["processes"], v["checks"]
    run_s = series[-1]["t"] - series[0]["t"] if series else 0
    doc = {
        "benchmark": "soak", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python bench/long_checks/soak.py " + " ".join(sys.argv[1:]), "args": vars(args),
        "full_run": args.samples >= 20_000,
        "device": "cpu (2 cores), tiny verifier", "cpu_threads_bind": launch.cpu_env().get("VLLM_CPU_OMP_THREADS_BIND"),
        "samples": len(expected), "acked": len(acked), "acked_twice": dupes, "never_acked": missing,
        "consumed": consumed, "failed": failed, "spool_files_left": len(left) if ok else None,
        "run_s": round(run_s, 1), "samples_per_s": round(len(set(acked)) / run_s, 1) if run_s else None,
        "processes": procs, "checks": checks, "passed": all(checks.values()), "events": events, "series": series,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print(json.dumps({k: doc[k] for k in ("samples", "acked", "acked_twice", "never_acked", "run_s", "samples_per_s",
                                          "checks", "passed")}, indent=1))  # fmt: skip
    for name, v in procs.items():
        print(f"{name:18s} RSS {v['rss']}  fds {v['fds']}")
    print("wrote", out.with_suffix(".json"), out.with_suffix(".png"))
    return 0 if doc["passed"] else 1


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["series"]
    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for name in ("vllm", "sidecar", "trainer"):
        for pid in dict.fromkeys(p[f"{name}_pid"] for p in s if f"{name}_pid" in p):
            pts = [p for p in s if p.get(f"{name}_pid") == pid]
            ax[0].plot([p["t"] for p in pts], [p[f"{name}_rss"] / 2**20 for p in pts], label=f"{name} {pid}")
            ax[1].plot([p["t"] for p in pts], [p[f"{name}_fds"] for p in pts], label=f"{name} {pid}")
    ax[0].set_ylabel("RSS (MiB)")
    ax[1].set_ylabel("open fds")
    ax[2].plot([p["t"] for p in s], [p["ledger_bytes"] / 2**20 for p in s], label="ledger (SQLite + WAL)")
    ax[2].set_ylabel("MiB")
    ax2 = ax[2].twinx()
    ax2.plot([p["t"] for p in s], [p["spool_files"] for p in s], color="tab:red", label="spool files")
    ax2.set_ylabel("spool files")
    ax[3].plot([p["t"] for p in s if p["consumed"] >= 0], [p["consumed"] for p in s if p["consumed"] >= 0])
    ax[3].set_ylabel("samples consumed")
    ax[3].set_xlabel("seconds")
    for a in ax:
        for e in doc["events"]:
            if "killed" in e["event"]:
                a.axvline(e["t"], color="grey", ls="--", lw=0.8)
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    ax[2].legend(loc="upper left", fontsize=7)
    ax2.legend(loc="upper right", fontsize=7)
    title = f"soak: {doc['samples']:,} samples, passed={doc['passed']}"
    ax[0].set_title(title if doc["full_run"] else title + " (SHORT RUN, not the 20,000-sample soak)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
