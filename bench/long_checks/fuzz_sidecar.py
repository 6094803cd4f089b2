#!/usr/bin/env python3
"""A long fuzz of the sidecar's REST surface: does any request, generated or hostile, get a 5xx,
go unanswered, make the sidecar's memory creep or stall its event loop?

One real ``hsstream serve`` (uvicorn, the SQLite ledger, its threads) on 127.0.0.1 with the tiny
verifier's tokenizer and its default limits, and nothing listening at its vLLM URL: every check
here is of the REST surface, which needs no engine. Against it:

* **generated** requests: schemathesis draws them from the sidecar's own OpenAPI schema (valid and
  invalid bodies, paths, query values) for every route, aimed in part at real jobs' ids, with
  non-finite numbers put into bodies and integers past 64 bits into queries;
* **hostile** requests, each a kind that once was (or could be) a 500 or a stall: an
  ``errors_offset`` of 2**63, NaN / Infinity / 1e400 in bodies that fail validation, token ids
  >= 2**31 and negative (no vocabulary check can catch them first), a 2,000-sample x 1,000-epoch
  job and one past the row limit, bodies over the limits (declared, sent, chunked), bad content
  types, bad tokens and authorization headers, unknown and malformed job ids, and status /
  cancel / delete races on real jobs from several threads;
* **token-less and slow bodies**: strangers' bodies (JSON of 14 MB sent whole, uploads announcing
  64 MiB, heads with no body at all), each to be answered 401 from its head with the rest
  drained (the sidecar's RSS must not grow with them); bodies with the token that stall
  mid-way, each to get a 408 after ``HSSTREAM_HTTP_BODY_TIMEOUT_S``, and one more body than
  ``HSSTREAM_MAX_UPLOADS_PER_CLIENT`` from this one address, to get a 429;
* **connections** that hold the server: slow heads (slowloris), connections that send nothing,
  connections idle after an answer; each must be closed by the sidecar.

All along, a prober thread asks ``/healthz`` on its own connection every 50 ms (its longest wait
is the event loop's longest stall) and psutil samples the sidecar's RSS. Prints a table and
writes the JSON; exits non-zero if any answer is >= 500 (but ``/readyz``'s documented 503), any
request is unanswered or a held connection is left open.

    python bench/long_checks/fuzz_sidecar.py --requests 20000 --out bench/results/fuzz_sidecar.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import rank_value  # noqa: E402
from connector.contract.rest_client import SidecarClient, SidecarError, auth_headers  # noqa: E402
from hsstream import launch  # noqa: E402
from hsstream.devstack import free_port  # noqa: E402

TOKEN = "fuzz-token"
AUTH = auth_headers(TOKEN)  # for the hand-made requests; the well-formed ones go through SidecarClient
NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400")


class Tally:
    """Requests by kind, answers by status, and what went unanswered; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_kind: collections.Counter = collections.Counter()
        self.by_status: collections.Counter = collections.Counter()
        self.status_by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.bad: list[dict] = []  # answers >= 500 (allowed ones aside) and unanswered requests
        self.unanswered = 0

    def answer(self, kind: str, status: int, what: str = "", text: str = "", allow_503: bool = False) -> None:
        with self.lock:
            self.by_kind[kind] += 1
            self.by_status[str(status)] += 1
            self.status_by_kind[kind][str(status)] += 1
            if status >= 500 and not (allow_503 and status == 503) and len(self.bad) < 50:
                self.bad.append({"kind": kind, "status": status, "request": what[:500], "answer": text[:300]})

    def lost(self, kind: str, what: str, err: BaseException) -> None:
        with self.lock:
            self.by_kind[kind] += 1
            self.by_status["unanswered"] += 1
            self.unanswered += 1
            if len(self.bad) < 50:
                self.bad.append({"kind": kind, "status": None, "request": what[:500], "error": repr(err)[:300]})

    def raw(self, kind: str, reply: bytes) -> int | None:
        """Tally an answer read off a raw socket; its status, None if there was none."""
        status = status_of(reply)
        if status is None:
            self.lost(kind, reply[:200].decode("latin-1"), RuntimeError("no answer"))
        else:
            self.answer(kind, status, text=reply[:300].decode("latin-1"))
        return status

    def over_499(self) -> int:
        return sum(1 for b in self.bad if b["status"] is not None)


class Prober(threading.Thread):
    """``/healthz`` every ``every_s`` on one keep-alive connection: each answer's latency, so the
    longest one bounds how long the event loop was held."""

    def __init__(self, url: str, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.stop_event = threading.Event()
        self.phase = "start"
        self.waits: list[tuple[str, float]] = []
        self.failures: list[str] = []

    def run(self) -> None:
        with SidecarClient(self.url, timeout=30) as c:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                try:
                    c.healthz()
                    self.waits.append((self.phase, time.monotonic() - t0))
                except SidecarError as e:
                    if e.unreachable:
                        self.failures.append(f"{self.phase}: {e}"[:200])
                    else:
                        self.waits.append((self.phase, time.monotonic() - t0))
                        self.failures.append(f"{self.phase}: not 200")
                self.stop_event.wait(self.every_s)

    def summary(self) -> dict:
        by_phase: dict[str, list[float]] = collections.defaultdict(list)
        for phase, w in self.waits:
            by_phase[phase].append(w)
        allw = sorted(w for _, w in self.waits)

        def q(xs: list[float], p: float) -> float:
            return round(rank_value(xs, p) * 1000, 1) if xs else 0.0

        return {
            "probes": len(allw), "failures": len(self.failures), "failure_examples": self.failures[:5],
            "longest_ms": q(allw, 1.0), "p99_ms": q(allw, 0.99), "median_ms": q(allw, 0.5),
            "longest_ms_by_phase": {p: q(ws, 1.0) for p, ws in by_phase.items()},
        }  # fmt: skip


class RssSampler(threading.Thread):
    def __init__(self, proc: psutil.Process, every_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.proc, self.every_s = proc, every_s
        self.stop_event = threading.Event()
        self.points: list[tuple[float, str, int]] = []
        self.phase = "start"
        self.t0 = time.monotonic()

    def rss(self) -> int:
        return self.proc.memory_info().rss + sum(c.memory_info().rss for c in self.proc.children(recursive=True))

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.points.append((time.monotonic() - self.t0, self.phase, self.rss()))
            except psutil.Error:
                return
            self.stop_event.wait(self.every_s)


def poison(body: object, at: int, text: str) -> str:
    """``body`` as JSON with its ``at``-th value (depth first, modulo how many) replaced by the
    non-finite number ``text``; a body with no values gets one beside it."""
    spots: list[tuple[object, object]] = []

    def walk(v: object) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                spots.append((v, k))
                walk(x)
        elif isinstance(v, list):
            for k, x in enumerate(v):
                spots.append((v, k))
                walk(x)

    body = json.loads(json.dumps(body))
    walk(body)
    marker = "\u0000non-finite\u0000"
    if spots:
        where, key = spots[at % len(spots)]
        where[key] = marker  # type: ignore[index]
    else:
        body = {"samples": body, "options": {"epochs": marker}}
    return json.dumps(body).replace(json.dumps(marker), text)


def real_jobs(url: str, sizes: tuple[int, ...]) -> list[str]:
    with SidecarClient(url, token=TOKEN) as c:
        return [c.create_job([{"token_ids": [1, 2, 3]}] * n).job_id for n in sizes]


def generated(url: str, n: int, batch: int, tally: Tally, jobs: list[str]) -> dict:
    """``n`` requests drawn by schemathesis from the sidecar's OpenAPI schema, in batches of
    ``batch`` examples with a different seed each (hypothesis stops no batch early here)."""
    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis import strategies as st

    with SidecarClient(url, token=TOKEN) as c:
        schema = schemathesis.openapi.from_dict(c.openapi())
    ops = [r.ok() for r in schema.get_all_operations()]
    session = requests.Session()
    counts = {"aimed_at_real_jobs": 0, "non_finite_bodies": 0, "huge_query_integers": 0}

    def one(case, job, bad) -> None:  # noqa: ANN001
        params = case.path_parameters or {}
        if job is not None and "job_id" in params:
            params["job_id"] = job
            counts["aimed_at_real_jobs"] += 1
        kind = f"generated {case.operation.label}"
        try:
            if bad is not None and case.operation.method.upper() == "POST" and case.operation.path == "/v1/jobs":
                counts["non_finite_bodies"] += 1
                text = poison(case.body, *bad)
                r = session.post(f"{url}/v1/jobs", data=text.encode(), timeout=60,
                                 headers={**AUTH, "content-type": "application/json"})  # fmt: skip
                what = f"POST /v1/jobs {text}"
            elif bad is not None and case.operation.label == "GET /v1/jobs/{job_id}":
                counts["huge_query_integers"] += 1
                big = str(2**63 + bad[0]) if bad[0] % 2 else str(-(10**30))
                r = session.get(f"{url}/v1/jobs/{params['job_id']}", headers=AUTH, timeout=60,
                                params={"errors_offset": big, "errors_limit": big})  # fmt: skip
                what = f"GET {r.url}"
            else:
                what = repr(case)
                r = case.call(base_url=url, session=session, headers=AUTH, timeout=60)
        except requests.RequestException as e:
            tally.lost(kind, repr(case), e)
            return
        tally.answer(kind, r.status_code, what, r.text, allow_503=case.operation.path == "/readyz")

    strategy = (st.one_of(*(op.as_strategy() for op in ops)), st.sampled_from([None, *jobs]),
                st.none() | st.tuples(st.integers(0, 50), st.sampled_from(NON_FINITE)))  # fmt: skip
    done, t0 = 0, time.monotonic()
    for i in range((n + batch - 1) // batch):
        size = min(batch, n - done)
        run = seed(1000 + i)(settings(max_examples=size, deadline=None, database=None,
                                      suppress_health_check=list(HealthCheck))(given(*strategy)(one)))  # fmt: skip
        before = sum(tally.by_kind.values())
        run()
        done += sum(tally.by_kind.values()) - before
        print(f"  generated {done:,}/{n:,} ({done / (time.monotonic() - t0):.0f}/s)", flush=True)
    return {"operations": sorted(o.label for o in ops), **counts}


def send(session: requests.Session, tally: Tally, kind: str, method: str, url: str, **kw) -> requests.Response | None:
    kw.setdefault("timeout", 120)
    try:
        r = session.request(method, url, **kw)
    except requests.RequestException as e:
        tally.lost(kind, f"{method} {url}", e)
        return None
    tally.answer(kind, r.status_code, f"{method} {url} {str(kw.get('data') or kw.get('json'))[:300]}", r.text,
                 allow_503=url.endswith("/readyz"))  # not ready (no vLLM) is its documented answer
    return r


def chunked(port: int, path: str, ctype: str, first: bytes, total: int, chunk: int = 1 << 20) -> bytes:
    """POST ``total`` bytes chunked (no Content-Length), raw, reading the early answer."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: {ctype}\r\nTransfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    s.sendall(head.encode() + f"{len(first):x}\r\n".encode() + first + b"\r\n")
    piece = f"{chunk:x}\r\n".encode() + b"[" * chunk + b"\r\n"
    try:
        for _ in range(total // chunk):
            s.sendall(piece)
        s.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # answered and closed: read the answer
    return read_reply(s)


def read_reply(s: socket.socket) -> bytes:
    reply = b""
    try:
        while data := s.recv(65536):
            reply += data
            end = reply.find(b"\r\n\r\n")
            if end > 0:
                length = next((int(x.split(b":")[1]) for x in reply[:end].lower().split(b"\r\n")
                               if x.startswith(b"content-length:")), 0)  # fmt: skip
                if len(reply) >= end + 4 + length:
                    break
    except (ConnectionResetError, TimeoutError, OSError):
        pass
    s.close()
    return reply


def status_of(reply: bytes) -> int | None:
    try:
        return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else None
    except (IndexError, ValueError):
        return None


def hostile(url: str, port: int, tally: Tally, jobs: list[str], prober: Prober, rss: RssSampler, big_epochs: int,
            race_s: float) -> dict:
    """The issue's list, each kind a few times; returns what each phase measured."""
    s = requests.Session()
    out: dict = {}
    jobs_url = f"{url}/v1/jobs"
    ctype = {**AUTH, "content-type": "application/json"}

    # numbers no column holds
    for off in ("9223372036854775808", "99999999999999999999999", "-1", "-9223372036854775809", "1e3", "NaN"):
        for job in jobs:
            send(s, tally, "hostile errors_offset past int64", "GET", f"{jobs_url}/{job}",
                 params={"errors_offset": off, "errors_limit": off}, headers=AUTH)  # fmt: skip
    templates = [
        '{"samples": [{"token_ids": [1]}], "options": {"epochs": %s}}',
        '{"samples": [{"token_ids": [1]}], "options": {"mode": "regenerate", "sampling": {"temperature": %s}}}',
        '{"samples": [{"token_ids": [1]}], "options": {"seed": %s}}',
        '{"samples": [{"token_ids": [1, %s]}]}',
        '{"samples": [{"messages": [{"role": "user", "content": "x", "weight": %s}]}]}',
        '{"samples": [{"prompt": "x"}], "extra": %s}',
        '{"samples": %s}',
        '{"samples": [{"token_ids": [1]}], "options": {"max_tokens_per_sample": %s}}',
        '[%s]',
        '%s',
    ]  # fmt: skip
    echoed = 0
    for t in templates:
        for bad in NON_FINITE:
            r = send(s, tally, "hostile non-finite number in a body", "POST", jobs_url, data=(t % bad).encode(),
                     headers=ctype)  # fmt: skip
            if r is not None and ("NaN" in r.text or "Infinity" in r.text):
                echoed += 1
    out["non_finite_echoed"] = echoed
    for ids in ("[2147483648]", "[-1]", "[4294967296]", "[1, 99999999999999999999]", "[9223372036854775808]",
                "[-9223372036854775809]", "[1.5]", "[true]", '["1"]', "[]"):
        send(s, tally, "hostile token ids outside 0..2^31", "POST", jobs_url,
             data=('{"samples": [{"token_ids": %s}]}' % ids).encode(), headers=ctype)  # fmt: skip

    # a job as big as the row limit allows, and one past it
    prober.phase = rss.phase = "big job"
    body = {"samples": [{"token_ids": [1 + i % 500] * 8} for i in range(2000)], "options": {"epochs": big_epochs}}
    t0 = time.monotonic()
    r = send(s, tally, f"hostile 2,000 samples x {big_epochs:,} epochs", "POST", jobs_url, json=body, headers=AUTH,
             timeout=600)  # fmt: skip
    admitted_s = time.monotonic() - t0
    big = {"status": r.status_code if r is not None else None, "seconds": round(admitted_s, 1)}
    if r is not None and r.status_code == 200:
        big["num_samples"] = r.json()["num_samples"]
        t0 = time.monotonic()
        d = send(s, tally, "hostile cancel of the big job", "DELETE", f"{jobs_url}/{r.json()['job_id']}", headers=AUTH,
                 timeout=600)  # fmt: skip
        big["cancel_status"], big["cancel_seconds"] = (d.status_code if d is not None else None,
                                                       round(time.monotonic() - t0, 1))  # fmt: skip
    body = {"samples": body["samples"] * 3, "options": {"epochs": 1000}}  # 6,000,000 rows > HSSTREAM_MAX_JOB_ROWS
    r = send(s, tally, "hostile 6,000 samples x 1,000 epochs", "POST", jobs_url, json=body, headers=AUTH)
    big["past_row_limit_status"] = r.status_code if r is not None else None
    out["big_job"] = big
    prober.phase = rss.phase = "hostile"

    # bodies over the limits: declared, sent whole, chunked
    sizes = {}
    r = send(s, tally, "hostile body over the JSON limit (17 MiB sent)", "POST", jobs_url,
             data=b'{"samples": [' + b"1," * (17 * 2**19) + b"1]}", headers=ctype)  # fmt: skip
    sizes["json_17_mib"] = r.status_code if r is not None else None
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {2**40}\r\n\r\n{{".encode())  # fmt: skip
    sizes["declared_1_tib"] = tally.raw("hostile Content-Length 1 TiB declared", read_reply(sock))
    part = (b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")  # a well-formed upload, only too long
    for path, ct, first in (("/v1/jobs", "application/json", b'{"samples": '),
                            ("/v1/jobs/upload", "multipart/form-data; boundary=xyz", part)):  # fmt: skip
        sizes[f"chunked_300_mib {path}"] = tally.raw(f"hostile chunked 300 MiB to {path}",
                                                     chunked(port, path, ct, first, 300 * 2**20))  # fmt: skip
    out["oversized"] = sizes

    # bad content types
    for ct in ("text/plain", "application/xml", "application/x-www-form-urlencoded", "multipart/form-data",
               "multipart/form-data; boundary=", "application/json; charset=utf-32", "", "\u00e9/\u00e9", "*/*",
               "application/json, text/plain"):  # fmt: skip
        for path in ("/v1/jobs", "/v1/jobs/upload"):
            try:
                headers = {**AUTH, "content-type": ct.encode("latin-1").decode("latin-1")}
            except UnicodeError:
                continue
            send(s, tally, "hostile bad content type", "POST", f"{url}{path}",
                 data=b'{"samples": [{"token_ids": [1]}]}', headers=headers)  # fmt: skip

    # bad tokens and authorization headers, on every kind of route
    bad_auth = ["", "Bearer", "Bearer ", f"Bearer {TOKEN}x", f"bearer {TOKEN[:-1]}", f"Basic {TOKEN}",
                "Bearer " + "a" * 8000, f"Bearer  {TOKEN}", f"Bearer {TOKEN} extra", "Bearer \u00ff\u00fe",
                f"{TOKEN}", "Bearer %00"]  # fmt: skip
    for a in bad_auth:
        for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", f"/v1/jobs/{jobs[0]}"),
                             ("DELETE", f"/v1/jobs/{jobs[-1]}"), ("GET", "/metrics"), ("GET", "/docs"),
                             ("GET", "/openapi.json"), ("GET", "/readyz")):  # fmt: skip
            r = send(s, tally, "hostile bad token / authorization", method, f"{url}{path}",
                     headers={"authorization": a} if a else {}, json={"samples": [{"token_ids": [1]}]})  # fmt: skip
    # unknown and malformed job ids
    rnd = random.Random(7)
    ids = ["0" * 16, "f" * 16, "".join(rnd.choice("0123456789abcdef") for _ in range(16)), "x", "a" * 5000,
           "%2e%2e", "..%2f..%2fetc%2fpasswd", "%00", "\u00e9\u00e8", "1;DROP TABLE jobs", "' OR 1=1 --", "%ff%fe"]
    for j in ids:
        for method, suffix in (("GET", ""), ("DELETE", ""), ("GET", "?errors_offset=1&errors_limit=5")):
            send(s, tally, "hostile unknown job id", method, f"{jobs_url}/{j}{suffix}", headers=AUTH)

    # status / cancel / delete races on real jobs, from several threads
    race_jobs = real_jobs(url, (1, 5, 50, 200) * 5)
    stop_at = time.monotonic() + race_s

    def racer(k: int) -> None:
        sess = requests.Session()
        r2 = random.Random(k)
        while time.monotonic() < stop_at:
            j = r2.choice(race_jobs)
            method, suffix = r2.choice([("GET", ""), ("DELETE", ""), ("GET", "?errors_offset=0&errors_limit=1000"),
                                        ("GET", "/"), ("DELETE", "/")])  # fmt: skip
            send(sess, tally, "hostile status/cancel race", method, f"{jobs_url}/{j}{suffix.rstrip('/')}",
                 headers=AUTH)  # fmt: skip
            if r2.random() < 0.05:
                r3 = send(sess, tally, "hostile status/cancel race", "POST", jobs_url, headers=AUTH,
                          json={"samples": [{"token_ids": [2, 3, 4]}] * r2.randint(1, 100)})  # fmt: skip
                if r3 is not None and r3.status_code == 200:
                    race_jobs.append(r3.json()["job_id"])

    prober.phase = rss.phase = "races"
    threads = [threading.Thread(target=racer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["race_jobs"] = len(race_jobs)
    prober.phase = rss.phase = "hostile"
    return out


def _raw_head(port: int, path: str, headers: dict[str, str], length: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {length}", *(f"{k}: {v}" for k, v in headers.items())]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return s


def tokenless_and_slow(url: str, port: int, tally: Tally, rss: RssSampler, n_tokenless: int, n_slow: int,
                       body_timeout_s: float) -> dict:
    """Strangers' bodies (no token) and bodies that stall; returns what each kind measured."""
    out: dict = {}
    # JSON bodies of 14 MB sent whole, without the token: answered from the head, drained, never parsed
    rss_before = rss.rss()
    body = b'{"samples": [{"token_ids": [' + b"1," * (7 * 10**6 - 1) + b'1]}]}'
    sess = requests.Session()
    t0 = time.monotonic()
    for _ in range(n_tokenless):
        send(sess, tally, "token-less JSON body of 14 MB (sent whole)", "POST", f"{url}/v1/jobs", data=body,
             headers={"content-type": "application/json"})  # fmt: skip
    out["tokenless_json_14mb"] = {"sent": n_tokenless, "seconds": round(time.monotonic() - t0, 1),
                                  "rss_growth_mib": round((rss.rss() - rss_before) / 2**20, 1)}  # fmt: skip

    # uploads announcing 64 MiB, 64 KiB of it sent: the 401 must come before the rest
    waits = []
    for _ in range(16):
        s = _raw_head(port, "/v1/jobs/upload", {"Content-Type": "multipart/form-data; boundary=b"}, 64 << 20)
        t0 = time.monotonic()
        s.sendall(b"--b\r\n" + b"x" * (64 << 10))
        s.settimeout(10)
        status = tally.raw("token-less upload announcing 64 MiB (64 KiB sent)", read_reply(s))
        waits.append((status, time.monotonic() - t0))
    # heads alone, the body never sent: answered at once, not held for the body timeout
    for _ in range(16):
        s = _raw_head(port, "/v1/jobs/upload", {"Content-Type": "multipart/form-data; boundary=b"}, 1 << 20)
        t0 = time.monotonic()
        s.settimeout(10)
        status = tally.raw("token-less head, no body ever", read_reply(s))
        waits.append((status, time.monotonic() - t0))
    out["tokenless_uploads"] = {"answers": dict(collections.Counter(str(w[0]) for w in waits)),
                                "seconds_to_answer_max": round(max(w[1] for w in waits), 2)}  # fmt: skip

    # bodies with the token that stall mid-way, as many as one client may have, and one more
    stalled = []
    for _ in range(n_slow):
        s = _raw_head(port, "/v1/jobs/upload", {**AUTH, "Content-Type": "multipart/form-data; boundary=b"}, 1 << 20)
        s.sendall(b"--b\r\n")
        stalled.append((s, time.monotonic()))
    time.sleep(0.5)
    extra = _raw_head(port, "/v1/jobs/upload", {**AUTH, "Content-Type": "multipart/form-data; boundary=b"}, 1 << 20)
    extra.settimeout(10)
    over_cap = tally.raw("one body over the per-client limit", read_reply(extra))
    results = []
    for s, t0 in stalled:
        s.settimeout(body_timeout_s + 30)
        status = tally.raw("body stalled mid-way (token)", read_reply(s))
        results.append((status, time.monotonic() - t0))
    out["stalled_bodies"] = {"opened": n_slow, "answers": dict(collections.Counter(str(r[0]) for r in results)),
                             "seconds_to_answer_min": round(min(r[1] for r in results), 1) if results else None,
                             "seconds_to_answer_max": round(max(r[1] for r in results), 1) if results else None,
                             "over_the_per_client_limit": over_cap}  # fmt: skip
    return out


def held_connections(port: int, tally: Tally, n_slow: int, n_idle: int, n_after: int) -> dict:
    """Connections that hold the server: a head one byte a second (slowloris), nothing at all,
    and idle after an answer. Each is given 30 s to be closed by the sidecar."""
    results: dict[str, list] = collections.defaultdict(list)
    lock = threading.Lock()

    def slow(k: int) -> None:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        t0 = time.monotonic()
        head = f"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nX-Slow-{k}: " + "a" * 60
        reply: bytes | None = None  # None: the sidecar neither answered nor closed
        try:
            for ch in head.encode():
                s.sendall(bytes([ch]))
                s.settimeout(1.0)
                try:
                    reply = s.recv(4096)
                    break  # answered (or closed) before the head was done
                except TimeoutError:
                    pass
                if time.monotonic() - t0 > 30:
                    break
        except (BrokenPipeError, ConnectionResetError):
            reply = b""
        closed = reply is not None
        if reply:
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
        with lock:
            results["slowloris"].append((closed, time.monotonic() - t0, status_of(reply or b"")))
        s.close()

    def idle(k: int, ask_first: bool) -> None:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        t0 = time.monotonic()
        if ask_first:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while b"\r\n\r\n" not in got or not got.endswith(b"}"):
                data = s.recv(4096)
                if not data:
                    break
                got += data
            tally.raw("connection idle after an answer: its request", got)
            t0 = time.monotonic()
        try:
            s.settimeout(30)
            data = s.recv(4096)
            rest = data
            while data:
                data = s.recv(4096)
            closed = True
        except TimeoutError:
            closed, rest = False, b""
        except OSError:
            closed, rest = True, b""
        with lock:
            results["idle after an answer" if ask_first else "idle, nothing sent"].append(
                (closed, time.monotonic() - t0, status_of(rest)))  # fmt: skip
        s.close()

    threads = [threading.Thread(target=slow, args=(k,)) for k in range(n_slow)]
    threads += [threading.Thread(target=idle, args=(k, False)) for k in range(n_idle)]
    threads += [threading.Thread(target=idle, args=(k, True)) for k in range(n_after)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {}
    for kind, rows in results.items():
        closed = [r for r in rows if r[0]]
        for r in rows:
            tally.by_kind[f"connection {kind}"] += 1
            if r[2] is not None:
                tally.by_status[str(r[2])] += 1
                tally.status_by_kind[f"connection {kind}"][str(r[2])] += 1
        out[kind] = {
            "opened": len(rows), "closed_by_sidecar": len(closed),
            "seconds_to_close_max": round(max((r[1] for r in closed), default=0), 1),
            "seconds_to_close_min": round(min((r[1] for r in closed), default=0), 1),
            "answers": dict(collections.Counter(str(r[2]) for r in rows)),
        }  # fmt: skip
    return out


def verdict(doc: dict) -> tuple[bool, bool]:
    """(passed, token-less and slow bodies as expected), from the result document alone, so that
    a unit test holds it and re-derives the committed result's verdict: no answer >= 500, none
    missing, no held connection left open, the sidecar alive and without a traceback, no
    non-finite number echoed back; token-less uploads answered 401 before their bodies are read,
    stalled bodies 408 and the one over the per-client limit 429."""
    sb = doc["tokenless_and_slow_bodies"]
    whole = doc["answers_by_kind_and_status"].get("token-less JSON body of 14 MB (sent whole)", {})
    slow_ok = (set(sb["tokenless_uploads"]["answers"]) == {"401"} and set(sb["stalled_bodies"]["answers"]) <= {"408"}
               and sb["stalled_bodies"]["over_the_per_client_limit"] == 429 and bool(whole)
               and whole.keys() <= {"401"})  # fmt: skip
    ok = (doc["answers_500_or_more"] == 0 and doc["unanswered"] == 0 and doc["connections_left_open"] == 0
          and doc["sidecar_alive_at_end"] and doc["tracebacks_in_log"] == 0 and doc["hostile"]["non_finite_echoed"] == 0
          and slow_ok)  # fmt: skip
    return ok, slow_ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000, help="generated requests (schemathesis)")
    ap.add_argument("--batch", type=int, default=500, help="examples per hypothesis run (each with its own seed)")
    ap.add_argument("--slow", type=int, default=32, help="slowloris connections")
    ap.add_argument("--idle", type=int, default=64,
                    help="connections that send nothing, and as many idle after an answer")  # fmt: skip
    ap.add_argument("--big-epochs", type=int, default=1000, help="epochs of the 2,000-sample job")
    ap.add_argument("--race-s", type=float, default=20.0, help="seconds of status/cancel races")
    ap.add_argument("--tokenless", type=int, default=81, help="token-less 14 MB JSON bodies sent whole")
    ap.add_argument("--stalled-bodies", type=int, default=4,
                    help="bodies with the token that stall mid-way (the per-client limit's worth)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/fuzz_sidecar.json")
    args = ap.parse_args()

    from hsstream.tiny_model import build_tiny_verifier

    model = str(build_tiny_verifier())
    run = Path(tempfile.mkdtemp(prefix="hsstream-fuzz-run-"))
    spool = Path(tempfile.mkdtemp(prefix="hsstream-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    port = free_port()
    env = launch.child_env({
        "HSSTREAM_SPOOL_DIR": str(spool), "HSSTREAM_RUN_DIR": str(run), "HSSTREAM_PORT": str(port),
        "HSSTREAM_HOST": "127.0.0.1", "HSSTREAM_MODEL": model, "HSSTREAM_LAYER_IDS": "2,6,9,12",
        "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "HSSTREAM_VLLM_DOWN_DEADLINE_S": "2", "HSSTREAM_API_TOKEN": TOKEN,
    })  # fmt: skip
    log = run / "sidecar.log"
    child = launch.spawn("sidecar", [sys.executable, "-m", "hsstream", "serve"], env, log)

    def stopped(_sig: int, _frame: object) -> None:
        """A SIGTERM: hypothesis would take an exception raised here for the test's, so the sidecar
        is stopped and its directories removed here, and the process ends at once."""
        child.stop(10)
        shutil.rmtree(spool, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
        os._exit(143)

    signal.signal(signal.SIGTERM, stopped)
    url = f"http://127.0.0.1:{port}"
    t_start = time.monotonic()
    try:
        launch.wait_http(f"{url}/healthz", child, 180)
        proc = psutil.Process(child.proc.pid)
        tally = Tally()
        prober, rss = Prober(url), RssSampler(proc)
        prober.start()
        rss.start()
        jobs = real_jobs(url, (1, 3, 40))
        prober.phase = rss.phase = "generated"
        print(f"sidecar pid {proc.pid} on {url}; {args.requests:,} generated requests", flush=True)
        t0 = time.monotonic()
        gen = generated(url, args.requests, args.batch, tally, jobs)
        gen["seconds"] = round(time.monotonic() - t0, 1)
        print("hostile requests", flush=True)
        prober.phase = rss.phase = "hostile"
        t0 = time.monotonic()
        hos = hostile(url, port, tally, jobs, prober, rss, args.big_epochs, args.race_s)
        hos["seconds"] = round(time.monotonic() - t0, 1)
        print("token-less and slow bodies", flush=True)
        prober.phase = rss.phase = "token-less and slow bodies"
        t0 = time.monotonic()
        slow_bodies = tokenless_and_slow(url, port, tally, rss, args.tokenless, args.stalled_bodies,
                                         float(env.get("HSSTREAM_HTTP_BODY_TIMEOUT_S", "60")))  # fmt: skip
        slow_bodies["seconds"] = round(time.monotonic() - t0, 1)
        print("held connections", flush=True)
        prober.phase = rss.phase = "held connections"
        conns = held_connections(port, tally, args.slow, args.idle, args.idle)
        prober.phase = rss.phase = "end"
        time.sleep(1)
        with SidecarClient(url, timeout=10) as c:
            alive = child.proc.poll() is None and c.healthz().ok
        prober.stop_event.set()
        rss.stop_event.set()
        prober.join()
        rss.join()
    finally:
        child.stop()
        shutil.rmtree(spool, ignore_errors=True)
    text = log.read_text(errors="replace")
    shutil.rmtree(run, ignore_errors=True)

    pts = rss.points
    gen_pts = [p for p in pts if p[1] == "generated"]
    base = gen_pts[min(len(gen_pts) - 1, 8)][2] if gen_pts else pts[0][2]  # after the first 2 s of traffic
    peak = max(p[2] for p in pts)
    peak_not_big = max((p[2] for p in pts if p[1] != "big job"), default=peak)
    connections_left_open = sum(v["opened"] - v["closed_by_sidecar"] for v in conns.values())
    total = sum(tally.by_kind.values())
    doc = {
        "what": "bench/long_checks/fuzz_sidecar.py: generated (schemathesis) and hostile requests and held connections against "
                "one real `hsstream serve` on 127.0.0.1 (tiny verifier's tokenizer, default limits, no vLLM behind it)",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "requests_total": total,
        "generated_requests": sum(v for k, v in tally.by_kind.items() if k.startswith("generated ")),
        "requests_by_kind": dict(sorted(tally.by_kind.items())),
        "answers_by_status": dict(sorted(tally.by_status.items())),
        "answers_by_kind_and_status": {k: dict(sorted(v.items())) for k, v in sorted(tally.status_by_kind.items())},
        "answers_500_or_more": tally.over_499(),
        "unanswered": tally.unanswered,
        "bad_examples": tally.bad[:20],
        "generated": gen,
        "hostile": hos,
        "tokenless_and_slow_bodies": slow_bodies,
        "held_connections": conns,
        "connections_left_open": connections_left_open,
        "healthz": prober.summary(),
        "rss": {
            "baseline_mib": round(base / 2**20, 1), "peak_mib": round(peak / 2**20, 1),
            "peak_growth_mib": round((peak - base) / 2**20, 1),
            "peak_growth_outside_big_job_mib": round((peak_not_big - base) / 2**20, 1),
            "end_mib": round(pts[-1][2] / 2**20, 1), "end_growth_mib": round((pts[-1][2] - base) / 2**20, 1),
            "samples": len(pts),
        },  # fmt: skip
        "sidecar_alive_at_end": alive,
        "tracebacks_in_log": text.count("Traceback"),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    ok, slow_ok = verdict(doc)
    doc["tokenless_and_slow_as_expected"] = slow_ok
    doc["verdict"] = "pass" if ok else "fail"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{'requests by kind':<58} {'n':>7}  answers")
    for k, v in sorted(tally.by_kind.items()):
        print(f"{k[:58]:<58} {v:>7}  {dict(sorted(tally.status_by_kind.get(k, {}).items()))}")
    print(f"\ntotal {total:,} requests ({doc['generated_requests']:,} generated); answers by status "
          f"{doc['answers_by_status']}")
    print(f">= 500: {doc['answers_500_or_more']}; unanswered: {doc['unanswered']}; held connections left open: "
          f"{connections_left_open} of {sum(v['opened'] for v in conns.values())}")
    for k, v in conns.items():
        print(f"  {k}: {v['closed_by_sidecar']}/{v['opened']} closed, {v['seconds_to_close_min']}-"
              f"{v['seconds_to_close_max']} s, answers {v['answers']}")
    h, r = doc["healthz"], doc["rss"]
    print(f"/healthz: {h['probes']:,} probes, longest {h['longest_ms']} ms, p99 {h['p99_ms']} ms, failures "
          f"{h['failures']}; by phase {h['longest_ms_by_phase']}")
    print(f"big job: {doc['hostile']['big_job']}")
    print(f"token-less and slow bodies: {slow_bodies}")
    print(f"RSS: baseline {r['baseline_mib']} MiB, peak +{r['peak_growth_mib']} MiB "
          f"(outside the big job +{r['peak_growth_outside_big_job_mib']}), end {r['end_growth_mib']:+} MiB")
    print(f"{doc['verdict']} in {doc['wall_s']} s -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
