"""``hsstream submit`` / ``hsstream status``: the sidecar's REST API from the shell."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hsstream import data_sources as DS

console = Console(stderr=True)
#: How long an upload waits for the sidecar's answer once its body is sent: the sidecar answers
#: when every row is tokenised and queued (about 3,000 rows/s on 2 CPU cores: bench/ingest.py).
ADMIT_TIMEOUT_S = 3600.0


def _client(url: str | None) -> httpx.Client:
    from connector.contract.settings import Settings

    s = Settings()
    base = url or f"http://{s.host}:{s.port}"
    headers = {"authorization": f"Bearer {s.api_token}"} if s.api_token else {}
    return httpx.Client(base_url=base, headers=headers, timeout=60)


def _explain(r: httpx.Response) -> str:
    try:
        d = r.json().get("detail", r.text)
    except ValueError:
        d = r.text
    return f"{r.status_code}: {d}"


class _Refused(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _call(c: httpx.Client, method: str, path: str, what: str = "", **kw: object) -> dict:
    """One REST call; a clear line and an exit code (3 unreachable, 1 refused) on failure."""
    try:
        r = c.request(method, path, **kw)  # type: ignore[arg-type]
    except httpx.HTTPError as e:
        console.print(f"[red]sidecar not reachable at {c.base_url}: {e}[/red]")
        raise _Refused(3) from e
    if r.status_code != 200:
        console.print(f"[red]{what}{_explain(r)}[/red]")
        raise _Refused(1)
    return r.json()


def submit(path: str, options: str, url: str | None, follow: bool, *, preset: str | None = None,
           fields: list[str] | None = None, split: str | None = None, limit: int | None = None,
           shuffle: bool = False, seed: int = 0, shuffle_buffer: int = DS.DEFAULT_SHUFFLE_BUFFER) -> int:
    """Upload a source's samples as one job (streamed: :func:`upload_samples`); prints the job id."""
    try:
        samples = DS.iter_samples(path, preset=preset, fields=fields, split=split, limit=limit, shuffle=shuffle,
                                  seed=seed, shuffle_buffer=shuffle_buffer)  # fmt: skip
    except (DS.DataSourceError, OSError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    with _client(url) as c:
        try:
            job = upload_samples(c, samples, options, filename=Path(path).name or "samples")
        except _Refused as e:
            return e.code
        print(job["job_id"])
        return follow_job(c, job["job_id"]) if follow else 0


class UploadError(RuntimeError):
    """The sidecar refused an upload, or the source failed while it was read."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def stream_upload(
    c: httpx.Client, samples: Iterable[dict], options: str | dict = "{}", *, filename: str = "samples.jsonl",
    counter: DS.Counter | None = None,
) -> dict:
    """POST ``samples`` to ``/v1/jobs/upload`` as JSONL made on the fly (a generator body, sent
    chunked): the client holds one chunk of rows, never the whole job. The sidecar's answer
    (``JobCreated``), or :class:`UploadError` (code 3: unreachable, 2: the source failed,
    1: refused) with one line saying why."""
    opts = options if isinstance(options, str) else json.dumps(options)
    boundary = uuid.uuid4().hex
    failed: list[BaseException] = []

    def source() -> Iterator[dict]:
        try:
            yield from samples
        except Exception as e:  # the source broke mid-way: whatever the sidecar makes of the cut body, say this
            failed.append(e)
            raise

    body = DS.multipart_jsonl(source(), boundary=boundary, options=opts, filename=filename, counter=counter)
    try:
        r = c.post("/v1/jobs/upload", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}"},
                   timeout=httpx.Timeout(60.0, read=ADMIT_TIMEOUT_S))  # the answer comes once the job is admitted
    except Exception as e:
        if failed:
            raise UploadError(f"{failed[0]} (nothing was queued)", 2) from failed[0]
        if isinstance(e, httpx.HTTPError):
            raise UploadError(f"sidecar not reachable at {c.base_url}: {e}", 3) from e
        raise
    if failed:
        if r.status_code == 200:  # the cut body still parsed (a transport that does not abort): take the job back
            with contextlib.suppress(httpx.HTTPError):
                c.delete(f"/v1/jobs/{r.json()['job_id']}")
        raise UploadError(f"{failed[0]} (nothing was queued)", 2) from failed[0]
    if r.status_code != 200:
        raise UploadError(f"job refused: {_explain(r)}", 1)
    return r.json()


def upload_samples(c: httpx.Client, samples: Iterable[dict], options: str = "{}", *, filename: str = "samples.jsonl") -> dict:
    """:func:`stream_upload` under a progress bar of rows sent; then the rows the sidecar refused."""
    counter = DS.Counter()
    with Progress(TextColumn("{task.description}"), TextColumn("{task.fields[rows]:,} rows"),
                  TextColumn("{task.fields[mib]:.1f} MiB"), TimeElapsedColumn(), TextColumn("{task.fields[detail]}"),
                  console=console, transient=False) as prog:  # fmt: skip
        task = prog.add_task(f"upload {filename}", rows=0, mib=0.0, detail="")

        def counted() -> Iterator[dict]:
            for s in samples:
                yield s
                if counter.rows % 1000 == 0:
                    prog.update(task, rows=counter.rows, mib=counter.bytes / 2**20)
            prog.update(task, rows=counter.rows, mib=counter.bytes / 2**20, detail="sent; the sidecar is admitting them")

        try:
            job = stream_upload(c, counted(), options, filename=filename, counter=counter)
        except UploadError as e:
            why = {1: "refused", 2: "stopped: the source failed", 3: "no answer"}.get(e.code, "failed")
            prog.update(task, rows=counter.rows, mib=counter.bytes / 2**20, detail=f"[red]{why}[/red]")
            prog.stop()
            console.print(f"[red]{e}[/red]")
            raise _Refused(e.code) from e
        refused = int(job.get("num_failed_at_submission", 0))
        detail = f"sent; the sidecar queued {job['num_samples']:,} (x epochs), refused {refused:,}"
        prog.update(task, rows=counter.rows, mib=counter.bytes / 2**20, detail=detail)
    for w in job.get("warnings") or []:
        console.print(f"[yellow]warning: {w}[/yellow]")
    return job


def follow_job(c: httpx.Client, job_id: str) -> int:
    """A progress bar of consumed + failed samples until the job ends."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[detail]}"), console=console) as prog:  # fmt: skip
        task = None
        while True:
            r = c.get(f"/v1/jobs/{job_id}")
            if r.status_code != 200:
                console.print(f"[red]{_explain(r)}[/red]")
                return 1
            st = r.json()
            cnt = st["counts"]
            done_n = cnt["consumed"] + cnt["failed"] + cnt["cancelled"]
            detail = " ".join(f"{k} {v}" for k, v in cnt.items() if v) + f"  {st['tokens_per_s']:,.0f} tok/s"
            if task is None:
                task = prog.add_task(f"job {job_id}", total=st["num_samples"], detail=detail)
            prog.update(task, completed=done_n, detail=detail)
            if st["done"]:
                break
            time.sleep(1.0)
    return 0 if cnt["failed"] == 0 else 1


def status(job_id: str | None, url: str | None) -> int:
    with _client(url) as c:
        try:
            body = _call(c, "GET", f"/v1/jobs/{job_id}" if job_id else "/v1/jobs")
        except _Refused as e:
            return e.code
        print(json.dumps(body, indent=1))
        return 0


