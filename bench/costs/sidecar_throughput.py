#!/usr/bin/env python3
"""Samples/s through the sidecar alone: is the control plane ever the bottleneck?

Three processes on this machine, as in production minus vLLM's work:

* a stand-in for vLLM (a bare ASGI app under uvicorn) that answers each ``/v1/completions`` at
  once and, as our connector would, writes the sample's small safetensors file into the spool
  (temporary name, then rename) and pushes its notice to the sidecar;
* the real sidecar (``python -m hsstream serve``: uvicorn, the SQLite ledger, the notice and
  delivery threads), profiled with py-spy while it runs;
* a trainer: ``HiddenStateStream`` over ``ipc://``, checking every sample and acking it.

One job of ``--samples`` samples goes through; the rate is taken over the middle 80 % of the
yields (start-up and drain left out) and over the whole job. The profile's top frames (self and
inclusive, in the sidecar process) say where the sidecar's time goes.

    python bench/costs/sidecar_throughput.py --rounds 5 --out bench/results/sidecar_throughput.json
    python bench/costs/sidecar_throughput.py --jobs 20 --no-profile --out bench/results/sidecar_successive_jobs.json
    python bench/costs/sidecar_throughput.py --concurrency 1 --credit 8 --samples 300 --rounds 3 --no-profile \
        --out bench/results/sidecar_hop_cpu.json   # one sample at a time: the bare notice -> trainer hop
    python bench/costs/sidecar_throughput.py --concurrency 1 --credit 8 --samples 200 --rounds 3 --pace-ms 25 \
        --notice-after-ms 3 -1 --no-profile --out bench/results/sidecar_hop_idle_cpu.json
        # samples 25 ms apart (an idle sidecar, as with a GPU's 1,024-token samples), each notice
        # 3 ms after its answer as the connector sends it, and before it, interleaved

Each yielded sample's hop from the notice to the trainer's socket is split by the stamps the
sidecar adds to the delivered notice (``notice_to_trainer_socket_ms``).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from connector import protocol as P  # noqa: E402
from connector.contract.rest_client import SidecarClient, SidecarError  # noqa: E402
from connector.contract.spool import leftover_entries  # noqa: E402
from hsstream.devstack import free_port  # noqa: E402
from bench.common import rank_value  # noqa: E402

TOKENS, LAYERS, HIDDEN = 16, 4, 128  # a 16 KiB sample: the control plane's cost, not the bytes'


def sample_bytes(token_ids: list[int]) -> tuple[bytes, str]:
    """One sample's file as the connector writes it (fixed content: the stand-in must be cheap)."""
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(0)
    hs = torch.randn((TOKENS, LAYERS, HIDDEN), generator=g).to(torch.bfloat16)
    ids = torch.tensor(token_ids)
    digest = P.checksum(hs.view(torch.uint8).numpy(), ids.numpy())
    return save({P.HIDDEN_STATES_KEY: hs, P.TOKEN_IDS_KEY: ids}), digest


async def read_body(receive) -> bytes:  # noqa: ANN001
    """A bare ASGI request's whole body (the stand-ins' one reader)."""
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            return body


def stand_in(port: int, spool: str, notice_ep: str, token_ids: list[int]) -> None:
    """The vLLM stand-in and fake producer (run in its own process)."""
    import asyncio

    import uvicorn
    import zmq

    data, digest = sample_bytes(token_ids)
    pace_s = float(os.environ.get("BENCH_STAND_IN_PACE_MS", "0")) / 1000
    # < 0: the notice before the answer (the file is ready first); >= 0: this long after it, as
    # our connector's notice comes (its copy and write follow the request's last step).
    notice_after_s = float(os.environ.get("BENCH_STAND_IN_NOTICE_AFTER_MS", "-1")) / 1000
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(notice_ep)
    models = json.dumps({"data": [{"id": "stand-in", "max_model_len": 4096}]}).encode()

    async def app(scope, receive, send):  # noqa: ANN001, ANN202
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        out = models
        if scope["path"] == "/v1/completions":
            if pace_s:
                await asyncio.sleep(pace_s)  # a request that takes a while, as a GPU's would
            req = json.loads(body)
            tag = P.tag_from_kv_params(req.get("kv_transfer_params"))
            rid = f"cmpl-{tag.key.job}-{tag.key.epoch}-{tag.key.index}-{tag.attempt}"
            name = P.file_name_for_request(rid)
            if notice_after_s < 0:
                produce(tag, rid, name)
            out = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": {P.KV_PARAMS_PATH_KEY: name}}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})
        if scope["path"] == "/v1/completions" and notice_after_s >= 0:
            await asyncio.sleep(notice_after_s)
            produce(tag, rid, name)

    def produce(tag: P.RequestTag, rid: str, name: str) -> None:
        tmp = os.path.join(spool, P.tmp_name_for(name))
        with open(tmp, "wb") as f:
            f.write(data)
        os.rename(tmp, os.path.join(spool, name))
        n = P.Notice(status=P.NoticeStatus.ok, request_id=rid, key=tag.key, attempt=tag.attempt, file=name,
                     num_tokens=TOKENS, layer_ids=list(range(LAYERS)), num_hidden_layers=LAYERS,
                     hidden_size=HIDDEN, dtype="bfloat16", nbytes=TOKENS * LAYERS * HIDDEN * 2, checksum=digest,
                     model="stand-in", sent_at=time.time())  # fmt: skip
        push.send(n.encode())

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def hop_stages(x, hops: dict[str, list[float]]) -> None:  # noqa: ANN001
    """One sample's notice → trainer-socket hop (seconds, one host's clock), and its parts from
    the stamps the sidecar adds to the delivered notice: ``in`` (to the sidecar's notice socket),
    ``queue`` (ledger, wake-up, credit, lease, send), ``to_trainer`` (the rest)."""
    n, t = x.notice, x.timings
    if n is None or n.sent_at is None or "received" not in t:
        return
    total = t["received"] - n.sent_at
    hops["total"].append(total)
    if {P.TIMING_SIDECAR_IN, P.TIMING_SIDECAR_QUEUE} <= set(n.timings):
        hops["in"].append(n.timings[P.TIMING_SIDECAR_IN])
        hops["queue"].append(n.timings[P.TIMING_SIDECAR_QUEUE])
        hops["to_trainer"].append(total - n.timings[P.TIMING_SIDECAR_IN] - n.timings[P.TIMING_SIDECAR_QUEUE])


def profile_summary(raw: Path, top: int = 15) -> dict:
    """py-spy's collapsed stacks → the frames with the most samples: self (where the CPU is) and
    inclusive for this project's and the vLLM client's (aiohttp) functions (which part of the work)."""
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    root = str(ROOT) + "/"
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        k = int(n)
        frames = []
        for f in stack.split(";"):
            if f.startswith(("process ", "thread ")) or " (" not in f:
                continue
            func, where = f.split(" (", 1)
            path = where.split(":")[0]
            ours = path.startswith(root) or (
                "site-packages" not in path and path.split("/")[0] in ("server", "connector", "trainer_client", "hsstream"))
            short = path[len(root):] if path.startswith(root) else "/".join(path.split("/")[-2:])
            frames.append((f"{func} ({short})", ours or "/aiohttp/" in path))
        if not frames:
            continue
        total += k
        self_c[frames[-1][0]] += k
        for f in {f for f, keep in frames if keep}:
            incl[f] += k

    def share(c: collections.Counter) -> list:
        return [[f, round(v / total, 4)] for f, v in c.most_common(top)]

    return {"samples": total, "self": share(self_c), "inclusive_ours_and_aiohttp": share(incl)}


def run_once(a: argparse.Namespace) -> dict:
    from trainer_client import HiddenStateStream

    spool = Path(tempfile.mkdtemp(prefix="hsstream-tput-", dir=a.spool_parent))
    run = Path(tempfile.mkdtemp(prefix="hsstream-tput-run-"))
    vport, aport = free_port(), free_port()
    token_ids = list(range(1, TOKENS + 1))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HSSTREAM_SPOOL_DIR": str(spool), "HSSTREAM_RUN_DIR": str(run),
           "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{vport}", "HSSTREAM_PORT": str(aport),
           "HSSTREAM_MAX_CONCURRENCY": str(a.concurrency), "HSSTREAM_LOG_LEVEL": "warning",
           "HSSTREAM_API_TOKEN": secrets.token_hex(16)}  # fmt: skip
    procs: list[subprocess.Popen] = []
    log = open(run / "sidecar.log", "w")  # noqa: SIM115
    rest = SidecarClient(f"http://127.0.0.1:{aport}", token=env["HSSTREAM_API_TOKEN"], timeout=120)
    try:
        sidecar = subprocess.Popen([sys.executable, "-m", "hsstream", "serve"], env=env, stdout=log, stderr=log,
                                   cwd=ROOT, start_new_session=True)  # fmt: skip
        procs.append(sidecar)
        for _ in range(300):
            try:
                rest.healthz()
                break
            except SidecarError:
                time.sleep(0.1)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--stand-in", str(vport), str(spool), f"ipc://{run}/notice.sock",
             json.dumps(token_ids)], env={**env, "BENCH_STAND_IN_PACE_MS": str(a.pace_ms),
                                                  "BENCH_STAND_IN_NOTICE_AFTER_MS": str(a.notice_after_ms)}, cwd=ROOT, start_new_session=True))  # fmt: skip
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{vport}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        prof = None
        raw = run / "profile.txt"
        if not a.no_profile and shutil.which("py-spy", path=str(Path(sys.executable).parent) + ":" + os.environ["PATH"]):
            spy = shutil.which("py-spy", path=str(Path(sys.executable).parent) + ":" + os.environ["PATH"])
            prof = subprocess.Popen([spy, "record", "--pid", str(sidecar.pid), "--rate", "200", "--format", "raw",
                                     "--output", str(raw), "--nonblocking", "--threads"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            time.sleep(1.0)
        def cpu_of(pid: int | None = None) -> float:
            import psutil

            ct = psutil.Process(pid).cpu_times()
            return ct.user + ct.system

        cpu0 = {"sidecar": cpu_of(sidecar.pid), "stand_in": cpu_of(procs[1].pid), "trainer": cpu_of()}
        t_submit = time.perf_counter()
        job = rest.create_job([{"token_ids": token_ids}] * a.samples).job_id
        stamps = []
        hops: dict[str, list[float]] = collections.defaultdict(list)
        with HiddenStateStream(f"ipc://{run}/delivery.sock", jobs=[job], spool_dir=spool, credit=a.credit,
                               timeout_s=60) as s:  # fmt: skip
            for x in s:
                stamps.append(time.perf_counter())
                hop_stages(x, hops)
            stream_stats = dict(s.stats)
        t_end = time.perf_counter()
        # CPU seconds of each process over the job (start-up left out): per sample, this is what
        # bounds the rate on a quiet machine, whatever else shares the cores.
        cpu1 = {"sidecar": cpu_of(sidecar.pid), "stand_in": cpu_of(procs[1].pid), "trainer": cpu_of()}
        cpu = {k: round(cpu1[k] - cpu0[k], 3) for k in cpu0}
        if prof is not None:
            prof.send_signal(signal.SIGINT)
            prof.wait(60)
        status = rest.job(job)
        left = leftover_entries(spool)
        # More jobs through the same sidecar (--jobs): does anything it keeps grow per job?
        import psutil

        successive = [{"job": 0, "samples_per_s": round(len(stamps) / (t_end - t_submit), 1),
                       "sidecar_cpu_ms_per_sample": round(1000 * cpu["sidecar"] / max(len(stamps), 1), 3),
                       "sidecar_rss_mib": round(psutil.Process(sidecar.pid).memory_info().rss / 2**20, 1)}]  # fmt: skip
        for j in range(1, a.jobs):
            c0, t0 = cpu_of(sidecar.pid), time.perf_counter()
            job_j = rest.create_job([{"token_ids": token_ids}] * a.samples).job_id
            with HiddenStateStream(f"ipc://{run}/delivery.sock", jobs=[job_j], spool_dir=spool,
                                   credit=a.credit, timeout_s=60) as s:  # fmt: skip
                n_j = sum(1 for _ in s)
            dt = time.perf_counter() - t0
            successive.append({"job": j, "yielded": n_j, "samples_per_s": round(n_j / dt, 1),
                               "sidecar_cpu_ms_per_sample": round(1000 * (cpu_of(sidecar.pid) - c0) / max(n_j, 1), 3),
                               "sidecar_rss_mib": round(psutil.Process(sidecar.pid).memory_info().rss / 2**20, 1),
                               "load_avg_1": round(os.getloadavg()[0], 2)})  # fmt: skip
            print(f"  job {j}: {successive[-1]}", flush=True)
        left = leftover_entries(spool)
    finally:
        rest.close()
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(spool, ignore_errors=True)
    n = len(stamps)
    lo, hi = int(n * 0.1), int(n * 0.9) - 1
    steady = (hi - lo) / (stamps[hi] - stamps[lo]) if n > 20 else float("nan")
    whole = n / (t_end - t_submit)
    res = {
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "samples": a.samples, "yielded": n, "consumed": status.counts.get("consumed"),
        "failed": status.counts.get("failed"), "left_in_spool": len(left),
        "file_bytes": len(sample_bytes(token_ids)[0]), "credit": a.credit, "concurrency": a.concurrency,
        "pace_ms": a.pace_ms, "notice_after_ms": a.notice_after_ms,
        "samples_per_s_steady": round(steady, 1), "samples_per_s_whole_job": round(whole, 1),
        "target_samples_per_s": 500, "cpu_s_during_job": cpu,
        "sidecar_cpu_ms_per_sample": round(1000 * cpu["sidecar"] / max(n, 1), 3),
        "sidecar_bound_samples_per_cpu_s": round(n / cpu["sidecar"], 1) if cpu["sidecar"] else None, "stream": {k: round(v, 3) if isinstance(v, float) else v for k, v in stream_stats.items()},
        "notice_to_trainer_socket_ms": {k: {f"p{q}": round(1000 * rank_value(v, q / 100), 3)
                                            for q in (50, 90, 99)} for k, v in hops.items()},
    }  # fmt: skip
    if len(successive) > 1:
        from bench.costs.sidecar_overhead import slope_rel

        res["successive_jobs"] = successive
        res["successive_jobs_trend_per_job"] = {k: slope_rel([x[k] for x in successive]) for k in
                                                ("samples_per_s", "sidecar_cpu_ms_per_sample", "sidecar_rss_mib")}  # fmt: skip
        res["successive_jobs_all_yielded"] = all(x.get("yielded", a.samples) == a.samples for x in successive)
    if raw.exists() and raw.stat().st_size:
        res["sidecar_profile"] = profile_summary(raw)
        if os.environ.get("HSSTREAM_BENCH_KEEP_PROFILE"):
            shutil.copy(raw, os.environ["HSSTREAM_BENCH_KEEP_PROFILE"])
    shutil.rmtree(run, ignore_errors=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--credit", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="the sidecar's HSSTREAM_MAX_CONCURRENCY")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1, help="jobs one after another through each round's sidecar "
                    "(the first is the measured one): per-job rate, CPU and RSS show anything growing per job")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="the stand-in answers each request after this "
                    "long: with --concurrency 1, samples arrive this far apart and the hop is measured on an idle "
                    "sidecar (as with 1,024-token samples from a GPU, ~25 ms apart)")
    ap.add_argument("--notice-after-ms", type=float, nargs="+", default=[-1.0], help="the stand-in sends each "
                    "notice this long after its answer, as our connector does (its copy and write follow the "
                    "request's last step); default -1: before the answer. Several values: each round runs each, "
                    "interleaved, and the hop is summarised per value")
    ap.add_argument("--out", default=None)
    ap.add_argument("--spool-parent", default="/dev/shm", help="a tmpfs for the spool (default /dev/shm)")
    ap.add_argument("--stand-in", nargs=4, metavar=("PORT", "SPOOL", "NOTICE_EP", "IDS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.stand_in:
        stand_in(int(a.stand_in[0]), a.stand_in[1], a.stand_in[2], json.loads(a.stand_in[3]))
        return 0

    runs = []
    orders = a.notice_after_ms
    for r, v in itertools.product(range(a.rounds), orders):  # each round runs every order, interleaved
        a.notice_after_ms = v
        res = run_once(a)
        runs.append(res)
        print(f"round {r}{f' (notice after {v} ms)' if len(orders) > 1 else ''}: "
              f"{res['samples_per_s_steady']:7.1f} samples/s steady, "
              f"{res['samples_per_s_whole_job']:7.1f} whole job, sidecar {res['sidecar_cpu_ms_per_sample']} ms CPU/sample, "
              f"yielded {res['yielded']}/{a.samples}, failed {res['failed']}, left in spool {res['left_in_spool']}, "
              f"load average {res['load_avg_1_5_15'][0]}", flush=True)  # fmt: skip
    summary = {k: round(statistics.median(r[k] for r in runs), 3) for k in
               ("samples_per_s_steady", "samples_per_s_whole_job", "sidecar_cpu_ms_per_sample",
                "sidecar_bound_samples_per_cpu_s")}  # fmt: skip
    # CPU per sample of each process (median over rounds): what bounds the rate on a quiet machine.
    summary["cpu_ms_per_sample"] = {p: round(statistics.median(1000 * r["cpu_s_during_job"][p] / max(r["yielded"], 1)
                                                               for r in runs), 3) for p in ("sidecar", "stand_in", "trainer")}  # fmt: skip
    summary["rounds"] = len(runs)
    summary["meets_target"] = summary["samples_per_s_steady"] >= 500
    print("\n| samples/s (steady, median) | samples/s (whole job) | sidecar CPU ms/sample | samples per sidecar CPU-s |")
    print("|---|---|---|---|")
    print(f"| {summary['samples_per_s_steady']} | {summary['samples_per_s_whole_job']} | "
          f"{summary['sidecar_cpu_ms_per_sample']} | {summary['sidecar_bound_samples_per_cpu_s']} |")
    print("CPU ms per sample (median):", summary["cpu_ms_per_sample"])
    summary["notice_to_trainer_socket_ms_p50"] = {
        k: round(statistics.median(r["notice_to_trainer_socket_ms"][k]["p50"] for r in runs), 3)
        for k in runs[0]["notice_to_trainer_socket_ms"]}  # fmt: skip
    print("notice -> trainer socket, ms p50 (median over rounds):", summary["notice_to_trainer_socket_ms_p50"])
    if len(orders) > 1:  # the same rounds split by the stand-in's notice order, side by side
        summary["notice_to_trainer_socket_ms_p50_by_notice_after_ms"] = by = {
            str(v): {k: round(statistics.median(r["notice_to_trainer_socket_ms"][k]["p50"] for r in runs
                                                if r["notice_after_ms"] == v), 3)
                     for k in runs[0]["notice_to_trainer_socket_ms"]} for v in orders}  # fmt: skip
        for v, hop in by.items():
            print(f"  notice after {v} ms:", hop)
    prof = next((r["sidecar_profile"] for r in reversed(runs) if "sidecar_profile" in r), None)
    if prof:
        print("\nsidecar (last run), inclusive share of py-spy samples (all threads; this project's and aiohttp's frames):")
        for f, v in prof["inclusive_ours_and_aiohttp"]:
            print(f"  {v:6.1%}  {f}")
        print("sidecar, self share:")
        for f, v in prof["self"]:
            print(f"  {v:6.1%}  {f}")
    out = {
        "what": "samples/s through the real sidecar with a stand-in vLLM that answers at once and writes "
                f"{TOKENS}-token files (+ notices) as the connector would, and a HiddenStateStream checking and acking",
        # Other work shares this machine's cores (load average per run): the rate is what they left
        # us; the sidecar's CPU per sample is the figure that does not depend on them.
        "machine": {"cpus": os.cpu_count()}, "target_samples_per_s": 500, "summary": summary, "runs": runs,
    }  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    ok = all(r["yielded"] == a.samples and not r["left_in_spool"] and not r["failed"]
             and r.get("successive_jobs_all_yielded", True) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
