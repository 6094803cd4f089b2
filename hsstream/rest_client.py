"""``hsstream submit`` / ``hsstream status``: the sidecar's REST API from the shell."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


def _client(url: str | None) -> httpx.Client:
    from connector.settings import Settings

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


def submit(path: str, options: str, url: str | None, follow: bool) -> int:
    p = Path(path)
    if not p.is_file():
        console.print(f"[red]no such file: {path}[/red]")
        return 2
    with _client(url) as c:
        try:
            job = _call(c, "POST", "/v1/jobs/upload", "job refused: ",
                        files={"file": (p.name, p.read_bytes())}, data={"options": options})  # fmt: skip
        except _Refused as e:
            return e.code
        print(job["job_id"])
        return follow_job(c, job["job_id"]) if follow else 0


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


