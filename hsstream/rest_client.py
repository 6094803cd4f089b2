"""``hsstream submit`` / ``hsstream status``: the sidecar's REST API from the shell.

The CLI's layer over the one typed client (``connector/contract/rest_client.py``): progress
bars, one red line per failure and the exit codes (3 unreachable, 2 the source failed, 1 refused)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from connector.contract.rest import JobCreated
from connector.contract.rest_client import SidecarClient, SidecarError, UploadCounter
from hsstream import job_options as JO
from trainer_client import data_sources as DS

console = Console(stderr=True)


def _client(url: str | None) -> SidecarClient:
    """The typed client at ``url``, or at ``http://HSSTREAM_HOST:HSSTREAM_PORT``, with the
    settings' token."""
    from connector.contract.settings import Settings

    s = Settings()
    return SidecarClient(url or f"http://{s.host}:{s.port}", token=s.api_token or "")


class _Refused(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _exit_code(e: SidecarError) -> int:
    """3: the sidecar is unreachable, 1: it refused."""
    return 3 if e.unreachable else 1


def submit(path: str, options: str, url: str | None, follow: bool, *, preset: str | None = None,
           fields: list[str] | None = None, split: str | None = None, limit: int | None = None,
           shuffle: bool = False, seed: int = 0, shuffle_buffer: int = DS.DEFAULT_SHUFFLE_BUFFER,
           job_flags: dict | None = None) -> int:
    """Upload a source's samples as one job (streamed: :func:`upload_samples`); prints the job id.
    ``options`` (``--options``' JSON) with ``job_flags`` over it (``hsstream/job_options.py``:
    ``on_invalid`` is skip unless one of them says otherwise). A JSON array cut off before its
    end is sent up to the cut, which is reported in one line."""
    try:
        opts = JO.build(options, **(job_flags or {}))
        samples = DS.iter_samples(path, preset=preset, fields=fields, split=split, limit=limit, shuffle=shuffle,
                                  seed=seed, shuffle_buffer=shuffle_buffer, on_truncated=say_truncated)  # fmt: skip
    except (DS.DataSourceError, JO.JobOptionsError, OSError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    with _client(url) as c:
        try:
            job = upload_samples(c, samples, json.dumps(opts), filename=Path(path).name or "samples")
        except _Refused as e:
            return e.code
        print(job.job_id)
        return follow_job(c, job.job_id) if follow else 0


def say_truncated(t: DS.TruncatedTail) -> None:
    """The one line about a JSON array cut off before its end (the rows before the cut are sent)."""
    console.print(f"[yellow]note: {t.line()}[/yellow]", soft_wrap=True)


def upload_samples(
    c: SidecarClient, samples: Iterable[dict], options: str = "{}", *, filename: str = "samples.jsonl"
) -> JobCreated:
    """:meth:`SidecarClient.upload` under a progress bar of rows sent; then the rows the sidecar
    refused. The sidecar's refusal, or the source failing, is one red line and :class:`_Refused`."""
    counter = UploadCounter()
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
            job = c.upload(counted(), options, filename=filename, counter=counter)
        except Exception as e:
            if isinstance(e, SidecarError):
                code, why = _exit_code(e), "no answer" if e.unreachable else "refused"
                line = str(e) if e.unreachable else f"job refused: {e}"
            else:  # the source broke while it was read: the client took back whatever got queued
                code, why, line = 2, "stopped: the source failed", f"{e} (nothing was queued)"
            prog.update(task, rows=counter.rows, mib=counter.bytes / 2**20, detail=f"[red]{why}[/red]")
            prog.stop()
            console.print(f"[red]{line}[/red]")
            raise _Refused(code) from e
        detail = f"sent; the sidecar queued {job.num_samples:,} (x epochs), skipped {job.num_failed_at_submission:,}"
        prog.update(task, rows=counter.rows, mib=counter.bytes / 2**20, detail=detail)
    for w in job.warnings:
        console.print(f"[yellow]warning: {w}[/yellow]")
    return job


def follow_job(c: SidecarClient, job_id: str) -> int:
    """A progress bar of consumed + failed samples until the job ends."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[detail]}"), console=console) as prog:  # fmt: skip
        task = None
        while True:
            try:
                st = c.job(job_id)
            except SidecarError as e:
                console.print(f"[red]{e}[/red]")
                return 1
            cnt = st.counts
            done_n = cnt["consumed"] + cnt["failed"] + cnt["cancelled"]
            detail = " ".join(f"{k} {v}" for k, v in cnt.items() if v) + f"  {st.tokens_per_s:,.0f} tok/s"
            if task is None:
                task = prog.add_task(f"job {job_id}", total=st.num_samples, detail=detail)
            prog.update(task, completed=done_n, detail=detail)
            if st.done:
                break
            time.sleep(1.0)
    return 0 if cnt["failed"] == 0 else 1


def status(job_id: str | None, url: str | None) -> int:
    with _client(url) as c:
        try:
            body = c.job(job_id).model_dump(mode="json") if job_id else [j.model_dump(mode="json") for j in c.jobs()]
        except SidecarError as e:
            console.print(f"[red]{e}[/red]")
            return _exit_code(e)
        print(json.dumps(body, indent=1))
        return 0
