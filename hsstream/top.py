"""``hsstream top``: a live terminal view of a running sidecar, refreshed from ``GET /v1/overview``.

While a job runs an operator wants to know, at a glance: is data flowing (samples/s,
tokens/s), is production ahead of training (ready samples, the spool against its budget) or
is training starved (each trainer's wait share). Everything shown is one overview snapshot,
so the figures on a frame add up; nothing is computed here but formatting.
"""

from __future__ import annotations

import signal
import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from connector.contract.rest import Overview
from connector.contract.rest_client import SidecarError
from hsstream.rest_client import _client

STATES = ("queued", "submitted", "ready", "leased", "consumed", "failed", "cancelled")


def share(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def proxy_line(proxy: str | None) -> Text | None:
    """The serving proxy's live draft (``GET /healthz``, open): ``None`` when no proxy is watched."""
    if not proxy:
        return None
    import httpx

    try:
        live = httpx.get(proxy.rstrip("/") + "/healthz", timeout=2).json()["live"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        return Text(f"live draft  unknown: the proxy at {proxy} did not answer ({type(e).__name__})", style="red")
    return Text(f"live draft  {live}  (proxy {proxy})")


def render(ov: Overview, url: str, interval: float, live: Text | None = None) -> Group:
    """One frame. Labels are stable words (the tests read figures after them)."""
    sp, rt = ov.spool, ov.rates
    fill = sp.file_bytes / sp.budget_bytes if sp.budget_bytes else 0.0
    head = Text.assemble(
        ("hsstream top", "bold"), f"  {url}  {time.strftime('%H:%M:%S')}  every {interval:g} s, Ctrl-C quits"
    )
    states = [k for k in STATES if k != "cancelled" or ov.samples.get(k)]  # cancelling is rare
    samples = "  ".join(f"{k} {ov.samples.get(k, 0):,}" for k in states)
    lines = [
        head,
        Text(f"jobs {ov.jobs_total:,}  done {ov.jobs_done:,}  running {ov.jobs_total - ov.jobs_done:,}"),
        Text(f"samples  {samples}"),
        Text(f"rate  {rt.samples_per_s:,.2f} samples/s  {rt.tokens_per_s:,.1f} tokens/s  "
             f"(consumed, last {rt.window_s:g} s)"),  # fmt: skip
        Text(f"spool  {sp.file_bytes:,} of {sp.budget_bytes:,} B ({100 * fill:.1f} %)  "
             f"reserved {sp.reserved_bytes:,} B  ready {ov.ready:,}",
             style="red" if fill > 0.9 else ""),  # fmt: skip
    ]
    if live is not None:
        lines.append(live)
    if ov.vllm_down_since_s is not None:
        lines.append(Text(f"vLLM unreachable for {ov.vllm_down_since_s:.0f} s", style="bold red"))
    jobs = Table(box=None, header_style="bold", pad_edge=False, collapse_padding=True)
    jobs.add_column("job", no_wrap=True, min_width=16)  # ids whole: they are what users copy
    jobs.add_column("state", no_wrap=True)
    for k in states:
        jobs.add_column(k, justify="right", no_wrap=True)
    jobs.add_column("of", justify="right", no_wrap=True)
    for j in ov.jobs:
        jobs.add_row(j.job_id, "done" if j.done else "running",
                     *(f"{j.counts.get(k, 0):,}" for k in states), f"{j.num_samples:,}")  # fmt: skip
    trainers = Table(box=None, header_style="bold", pad_edge=False, collapse_padding=True)
    for col in ("trainer", "credit", "delivered", "acked", "wait now", "wait all", "seen"):
        trainers.add_column(col, justify="left" if col == "trainer" else "right", no_wrap=True)
    trainers.add_column("jobs", overflow="fold")  # last: a long list folds, the figures stay put
    for t in ov.trainers:
        trainers.add_row(t.id, f"{t.credit:,}", f"{t.delivered:,}", f"{t.acked:,}",
                         share(t.wait_share_recent), share(t.wait_share), f"{t.last_seen_s:.0f} s ago",
                         "all" if t.jobs is None else " ".join(t.jobs))  # fmt: skip
    return Group(
        *lines,
        Text(""),
        *((Text(f"jobs (latest {len(ov.jobs)})", style="bold"), jobs) if ov.jobs else (Text("no jobs yet"),)),
        Text(""),
        *((Text(f"trainers {len(ov.trainers)}", style="bold"), trainers) if ov.trainers
          else (Text("no trainer connected"),)),
    )


def _line(e: SidecarError) -> str:
    return str(e) if e.unreachable else f"GET /v1/overview: {e}"


def run_top(url: str | None, interval: float, once: bool, proxy: str | None = None) -> int:
    console = Console()
    with _client(url) as c:
        base = c.base_url
        if once:
            try:
                console.print(render(c.overview(), base, interval, proxy_line(proxy)))
            except SidecarError as e:
                Console(stderr=True).print(f"[red]{_line(e)}[/red]")
                return 3 if e.unreachable else 1
            return 0
        # Ctrl-C sets a flag the loop checks between short sleeps rather than relying on a
        # KeyboardInterrupt landing in the loop: one raised inside a finaliser or a library's
        # callback is printed and swallowed. (test_top.py saw the view keep refreshing after
        # Ctrl-C in loaded full-suite runs; the flag leaves no such window.)
        stop = threading.Event()
        old = signal.signal(signal.SIGINT, lambda *_: stop.set())
        try:
            with Live(Text(f"connecting to {base} …"), console=console, auto_refresh=False, screen=False) as live:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        frame = render(c.overview(), base, interval, proxy_line(proxy))
                    except SidecarError as e:
                        frame = Text(f"{_line(e)} (retrying every {interval:g} s)", style="red")
                    if stop.is_set():
                        break
                    live.update(frame, refresh=True)
                    while not stop.is_set() and time.monotonic() - t0 < interval:
                        time.sleep(min(0.05, max(0.0, interval - (time.monotonic() - t0))))
        except KeyboardInterrupt:  # a second Ctrl-C, or one before the handler was installed
            pass
        finally:
            signal.signal(signal.SIGINT, old)
        return 0
