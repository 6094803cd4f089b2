#!/usr/bin/env python3
"""A 1M-line JSONL through ``hsstream submit`` into a real ``hsstream serve``: memory and rows/s.

Three processes, no vLLM: the real sidecar (tiny verifier's tokenizer, SQLite ledger), a
stand-in for vLLM that answers ``/v1/models`` and holds every ``/v1/completions`` open (so the
sidecar admits the whole job and sends nothing on), and ``python -m hsstream submit`` itself.

Measured:

* the client's peak RSS (``ru_maxrss`` of the child) for the big file, minus the same for a
  1,000-line file: the growth in the number of rows (the upload is made on the fly);
* the sidecar's peak RSS growth during the upload and admission: its high-water mark
  (``VmHWM``, reset through ``/proc/PID/clear_refs`` just before) minus its RSS before;
  and its RSS once the answer came;
* rows/s: rows over the wall time of ``hsstream submit`` (start to job id, admission included).

    python bench/costs/ingest.py --rows 1000000 --out bench/results/ingest_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from connector.contract.rest_client import SidecarClient, SidecarError  # noqa: E402

MIB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stand_in(port: int) -> None:
    """vLLM's seam, answering the model probe and holding every completion open."""
    import asyncio

    import uvicorn

    models = json.dumps({"data": [{"id": "stand-in", "max_model_len": 4096}]}).encode()

    async def app(scope, receive, send):  # noqa: ANN001, ANN202
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/v1/completions":
            await asyncio.sleep(3600)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": models})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def write_jsonl(path: Path, rows: int, chat_every: int) -> int:
    with path.open("w") as f:
        for i in range(rows):
            if chat_every and i % chat_every == 0:
                r = {"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}: what comes next?"},
                                                 {"role": "assistant", "content": f"The number {i + 1}."}]}  # fmt: skip
            else:
                r = {"id": f"p{i}", "prompt": f"Sample {i}: the quick brown fox jumps over the lazy dog."}
            f.write(json.dumps(r) + "\n")
    return path.stat().st_size


def proc_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def run_submit(path: Path, api: str, env: dict) -> dict:
    """``hsstream submit`` as a child: wall time, exit code, peak RSS (ru_maxrss), job id."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "hsstream", "submit", str(path), "--url", api], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out: dict = {}

    def pump() -> None:
        out["stdout"], out["stderr"] = p.stdout.read(), p.stderr.read()  # type: ignore[union-attr]

    th = threading.Thread(target=pump)
    th.start()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    th.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": p.returncode, "wall_s": round(wall, 3), "peak_rss_mib": round(ru.ru_maxrss / 1024, 1),
            "job_id": out["stdout"].decode().strip(), "stderr_tail": out["stderr"].decode()[-600:]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--chat-every", type=int, default=0, help="every Nth row a 2-turn chat (0: prompts only)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/ingest_cpu.json"))
    ap.add_argument("--stand-in", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.stand_in:
        stand_in(a.stand_in)
        return 0

    from hsstream.tiny_model import build_tiny_verifier

    work = Path(tempfile.mkdtemp(prefix="hsstream-ingest-"))
    big, small = work / "big.jsonl", work / "small.jsonl"
    t0 = time.perf_counter()
    nbytes = write_jsonl(big, a.rows, a.chat_every)
    write_jsonl(small, 1000, a.chat_every)
    print(f"wrote {a.rows:,} rows, {nbytes / MIB:.1f} MiB in {time.perf_counter() - t0:.1f} s", flush=True)
    vport, aport = free_port(), free_port()
    api = f"http://127.0.0.1:{aport}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HSSTREAM_SPOOL_DIR": str(work / "spool"),
           "HSSTREAM_RUN_DIR": str(work / "run"), "HSSTREAM_STATE_DIR": str(work / "state"),
           "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{vport}", "HSSTREAM_PORT": str(aport),
           "HSSTREAM_MODEL": str(build_tiny_verifier()), "HSSTREAM_MAX_CONCURRENCY": "2",
           "HSSTREAM_LOG_LEVEL": "warning", "HSSTREAM_MAX_JOB_SAMPLES": str(max(a.rows, 1000)),
           "HSSTREAM_MAX_JOB_ROWS": str(max(a.rows, 1000))}  # fmt: skip
    env["HSSTREAM_API_TOKEN"] = token = secrets.token_hex(16)
    rest = SidecarClient(api, token=token)
    procs = []
    log = open(work / "sidecar.log", "w")  # noqa: SIM115
    try:
        procs.append(subprocess.Popen([sys.executable, __file__, "--stand-in", str(vport)], env=env, cwd=ROOT))
        sidecar = subprocess.Popen([sys.executable, "-m", "hsstream", "serve"], env=env, stdout=log, stderr=log, cwd=ROOT)
        procs.append(sidecar)
        for _ in range(600):
            try:
                rest.healthz()
                break
            except SidecarError:
                time.sleep(0.1)
        warm = run_submit(small, api, env)  # the tokenizer, the first job: out of the figure
        assert warm["rc"] == 0, warm
        rest.cancel(warm["job_id"])
        time.sleep(1.0)
        before = proc_kib(sidecar.pid, "VmRSS")
        Path(f"/proc/{sidecar.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        samples, stop = [], threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                samples.append((time.perf_counter(), proc_kib(sidecar.pid, "VmRSS")))

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        res = run_submit(big, api, env)
        stop.set()
        th.join()
        hwm, after = proc_kib(sidecar.pid, "VmHWM"), proc_kib(sidecar.pid, "VmRSS")
        st = rest.job(res["job_id"]) if res["rc"] == 0 else None
        if res["rc"] == 0:
            SidecarClient(api, token=token, timeout=600).cancel(res["job_id"])
        client_small = run_submit(small, api, env)
        if client_small["rc"] == 0:
            rest.cancel(client_small["job_id"])
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    sidecar_growth = (hwm - before) / 1024
    result = {
        "what": "hsstream submit of a JSONL file to a real hsstream serve (stand-in vLLM holding requests)",
        "rows": a.rows, "file_mib": round(nbytes / MIB, 1), "chat_every": a.chat_every,
        "submit_rc": res["rc"], "job_num_samples": st.num_samples if st else None,
        "wall_s": res["wall_s"], "rows_per_s": round(a.rows / res["wall_s"], 1) if res["rc"] == 0 else None,
        "client_peak_rss_mib": res["peak_rss_mib"], "client_peak_rss_mib_1000_rows": client_small["peak_rss_mib"],
        "client_rss_growth_mib": round(res["peak_rss_mib"] - client_small["peak_rss_mib"], 1),
        "sidecar_rss_before_mib": round(before / 1024, 1), "sidecar_peak_rss_mib": round(hwm / 1024, 1),
        "sidecar_rss_after_mib": round(after / 1024, 1), "sidecar_peak_rss_growth_mib": round(sidecar_growth, 1),
        "sidecar_rss_growth_target_mib": 100, "sidecar_within_target": sidecar_growth <= 100,
        "sidecar_rss_trace_mib": [(round(t - samples[0][0], 1), round(k / 1024)) for t, k in samples[:: max(1, len(samples) // 60)]]
        if samples else [],
        "stderr_tail": res["stderr_tail"] if res["rc"] else "",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")},
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "sidecar_rss_trace_mib"}, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if res["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
