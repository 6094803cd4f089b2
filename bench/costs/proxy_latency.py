"""What the serving proxy adds to each request and to each streamed chunk (issue 43's targets:
≤ 5 ms p99 per request, ≤ 1 ms p99 per chunk).

Three processes on this host: an upstream that answers like vLLM's OpenAI routes and stamps its
own times (``--upstream stub``, the default: what is measured is the proxy, not a model), the
proxy (``hsstream proxy serve``, real uvicorn, its tee on and sampling every request: the tee's
thread parses each one in the proxy's process, as in production), and this client. Every
round sends the same four requests, interleaved so both paths share the host's noise: straight
to the upstream and through the proxy, non-streamed and streamed.

* **per request**: the client's time from sending to the last byte, minus the upstream's own
  time from receiving the request to sending its last byte (stamped in the reply): what the
  path added, both directions. Direct: the kernel and HTTP stacks only; proxied: those twice
  and the proxy.
* **per chunk**: each streamed event carries the upstream's clock (``time.perf_counter_ns``,
  CLOCK_MONOTONIC, one clock for every process here) when it was written; the client's clock
  when it read the event, minus it.

"Added" is the proxied quantile minus the direct one. Quoted over every sample, and over the
steady window (the samples after the first ``--warmup`` rounds). ``--upstream vllm`` puts the
tiny verifier in vLLM (CPU) behind both paths instead, and reports the same figures from its
replies (per request: the whole time, since vLLM stamps nothing; per chunk: the gap between
chunks).

    python bench/costs/proxy_latency.py --quick            # smoke: 60 rounds (~1 min)
    python bench/costs/proxy_latency.py                    # 2,000 rounds (~5 min on a quiet host)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.common import pctl  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STUB = r'''
import asyncio, json, sys, time
from aiohttp import web
CHUNKS, GAP = int(sys.argv[2]), float(sys.argv[3])
PAD = "x" * 120  # about the size of one of vLLM's chat chunks

async def chat(req):
    t_recv = time.perf_counter_ns()
    body = await req.json()
    if not body.get("stream"):
        out = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "y" * 400}, "finish_reason": "length"}],
               "usage": {"prompt_tokens": 10, "completion_tokens": 100, "total_tokens": 110}}
        t_send = time.perf_counter_ns()
        return web.Response(body=json.dumps({**out, "t_recv": t_recv, "t_send": t_send}).encode(),
                            content_type="application/json")
    resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
    await resp.prepare(req)
    for i in range(CHUNKS):
        ev = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "i": i, "pad": PAD,
              "choices": [{"index": 0, "delta": {"content": "tok "}}], "t": time.perf_counter_ns()}
        await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        await asyncio.sleep(GAP)
    await resp.write(b'data: {"t_recv": %d, "t_send": %d}\n\ndata: [DONE]\n\n' % (t_recv, time.perf_counter_ns()))
    return resp

app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/v1/models", lambda r: web.json_response({"data": []}))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
'''


def proxy_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def wait_up(url: str, timeout: float = 600) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def q(xs: list[float], p: float) -> float | None:
    return pctl(xs, p / 100)


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": _r(q(xs, 50)), "p90_ms": _r(q(xs, 90)), "p99_ms": _r(q(xs, 99)),
            "max_ms": _r(max(xs) if xs else None), "mean_ms": _r(statistics.fmean(xs) if xs else None)}  # fmt: skip


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def one(client, url: str, stream: bool, stub: bool, model: str) -> tuple[float, list[float]]:  # noqa: ANN001
    """(per-request ms, per-chunk ms list) for one request."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32,
            "temperature": 0, **({"stream": True} if stream else {})}  # fmt: skip
    t0 = time.perf_counter_ns()
    chunks: list[float] = []
    last = None
    up = None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        if not stream:
            data = r.read()
            t1 = time.perf_counter_ns()
            if stub:
                j = json.loads(data)
                up = j["t_send"] - j["t_recv"]
            return ((t1 - t0) - (up or 0)) / 1e6, []
        buf = b""
        for raw in r.iter_raw():
            now = time.perf_counter_ns()
            buf += raw
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if not ev.startswith(b"data: {"):
                    continue
                j = json.loads(ev[6:])
                if stub and "t" in j:
                    chunks.append((now - j["t"]) / 1e6)
                elif stub and "t_recv" in j:
                    up = j["t_send"] - j["t_recv"]
                elif not stub:
                    if last is not None:
                        chunks.append((now - last) / 1e6)
                    last = now
    t1 = time.perf_counter_ns()
    return ((t1 - t0) - (up or 0)) / 1e6, chunks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="60 rounds, 16 chunks: a smoke run, not a figure")
    ap.add_argument("--chunks", type=int, default=32, help="streamed events per reply (stub)")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="between streamed events (stub)")
    ap.add_argument("--warmup", type=int, default=50, help="rounds left out of the steady window")
    ap.add_argument("--upstream", choices=("stub", "vllm"), default="stub")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.chunks, a.warmup = 60, 16, 10
    import httpx

    from hsstream import launch

    wd = Path(tempfile.mkdtemp(prefix="hsstream-proxy-bench-"))
    procs: list[launch.Child] = []
    env = launch.child_env({"HSSTREAM_PROXY_STATE_DIR": str(wd / "proxy"), "HSSTREAM_PROXY_SIDECAR_URL":
                            f"http://127.0.0.1:{free_port()}", "HSSTREAM_PROXY_HOLDOUT_FRACTION": "0"})  # fmt: skip
    try:
        if a.upstream == "stub":
            up_port = free_port()
            (wd / "stub.py").write_text(STUB)
            procs.append(launch.spawn("stub", [sys.executable, str(wd / "stub.py"), str(up_port), str(a.chunks),
                                               str(a.gap_ms / 1000)], env, wd / "stub.log"))  # fmt: skip
            upstream, model = f"http://127.0.0.1:{up_port}", "m"
            wait_up(upstream + "/v1/models", 60)
        else:
            from hsstream.proxy.engines import EngineManager
            from hsstream.tiny_model import build_tiny_verifier

            em = EngineManager(model=str(build_tiny_verifier()), log_dir=wd, served_model_name="verifier")
            upstream, child = em.start(None, "v0")
            procs.append(child)
            model = "verifier"
        px_port = free_port()
        procs.append(launch.spawn("proxy", [sys.executable, "-m", "hsstream", "proxy", "serve", "--upstream", upstream,
                                            "--port", str(px_port)], env, wd / "proxy.log"))  # fmt: skip
        proxy = f"http://127.0.0.1:{px_port}"
        wait_up(proxy + "/healthz", 120)
        stub = a.upstream == "stub"
        res: dict = {k: {"request": [], "chunk": [], "round": []} for k in
                     ("direct", "proxied", "direct_stream", "proxied_stream")}  # fmt: skip
        t_start = time.time()
        cpu0 = proxy_cpu_s(procs[-1].proc.pid)
        with httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=4)) as c:
            for i in range(a.rounds):
                for name, url, stream in (("direct", upstream, False), ("proxied", proxy, False),
                                          ("direct_stream", upstream, True), ("proxied_stream", proxy, True)):  # fmt: skip
                    req_ms, chunks = one(c, url, stream, stub, model)
                    res[name]["request"].append(req_ms)
                    res[name]["chunk"].extend(chunks)
                    res[name]["round"].extend([i] * len(chunks))
                if (i + 1) % max(1, a.rounds // 10) == 0:
                    print(f"  {i + 1}/{a.rounds} rounds", file=sys.stderr, flush=True)
        wall = time.time() - t_start
        m = httpx.get(proxy + "/metrics", timeout=10).text
        cpu = proxy_cpu_s(procs[-1].proc.pid) - cpu0
    finally:
        for p in reversed(procs):
            p.stop()
    tee = {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in m.splitlines()
           if line.startswith("hsstream_proxy_tee_total{")}  # fmt: skip
    out: dict = {"upstream": a.upstream, "rounds": a.rounds, "chunks_per_stream": a.chunks if stub else None,
                 "gap_ms": a.gap_ms if stub else None, "warmup_rounds": a.warmup, "wall_s": round(wall, 1),
                 "quick": a.quick, "host": os.uname().nodename, "cpus": len(os.sched_getaffinity(0)),
                 "loadavg_at_end": os.getloadavg(), "tee_outcomes": tee, "arms": {},
                 # the proxy process's CPU (user + system, all its threads: the tee's too) per proxied
                 # request: what it costs whatever the host's load, unlike the latencies
                 "proxy_cpu_ms_per_request": round(1000 * cpu / (2 * a.rounds), 3)}  # fmt: skip
    for name, v in res.items():
        steady_req = v["request"][a.warmup:]
        steady_chunk = [x for x, r in zip(v["chunk"], v["round"]) if r >= a.warmup]
        out["arms"][name] = {"per_request": {"all": summary(v["request"]), "steady": summary(steady_req)},
                             "per_chunk": {"all": summary(v["chunk"]), "steady": summary(steady_chunk)}}  # fmt: skip
    added: dict = {}
    for kind, (d, p) in {"per_request": ("direct", "proxied"), "per_request_stream": ("direct_stream", "proxied_stream"),
                         "per_chunk": ("direct_stream", "proxied_stream")}.items():  # fmt: skip
        key = "per_chunk" if kind == "per_chunk" else "per_request"
        added[kind] = {w: {s: _r((out["arms"][p][key][w][s] or 0) - (out["arms"][d][key][w][s] or 0))
                           for s in ("p50_ms", "p99_ms")} for w in ("all", "steady")}  # fmt: skip
    out["added"] = added
    out["targets"] = {"per_request_p99_ms": 5.0, "per_chunk_p99_ms": 1.0}
    out["met"] = {"per_request": max(added["per_request"]["all"]["p99_ms"], added["per_request_stream"]["all"]["p99_ms"]) <= 5.0,
                  "per_chunk": added["per_chunk"]["all"]["p99_ms"] <= 1.0}  # fmt: skip
    print(f"{'arm':<16}{'req p50':>9}{'req p99':>9}{'chunk p50':>11}{'chunk p99':>11}   (ms, all samples)")
    for name, v in out["arms"].items():
        r, ch = v["per_request"]["all"], v["per_chunk"]["all"]
        print(f"{name:<16}{r['p50_ms']:>9}{r['p99_ms']:>9}{str(ch['p50_ms']):>11}{str(ch['p99_ms']):>11}")
    print("added by the proxy (proxied - direct):", json.dumps(added))
    print(f"proxy CPU per proxied request: {out['proxy_cpu_ms_per_request']} ms")
    print("targets met:", out["met"], "(a --quick run is a smoke test, not a figure)" if a.quick else "")
    dest = Path(a.out or ROOT / "bench" / "results" / f"proxy_latency_{a.upstream}{'_quick' if a.quick else ''}_cpu.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
