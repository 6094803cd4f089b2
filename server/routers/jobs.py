"""Jobs: create (JSON or JSONL upload), list, status, token counts, cancel."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections import Counter
from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, HTTPException, Query, UploadFile
from pydantic import ValidationError

from connector.contract.rest import (
    JobBrief,
    JobCancelled,
    JobCreated,
    JobIn,
    JobOptions,
    JobStatus,
    SampleError,
    SampleIn,
    TokenCounts,
)
from connector.contract.sample_tokens import SampleRefused
from connector.contract.settings import Settings
from server.admission import check_job_size, too_many_samples
from server.content_type import expects
from server.dependencies import Services, ServicesDep, job_or_404, require_token
from server.ledger import Job, NewSample
from server.model_shape import over_budget_reason

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_token)])
JobDep = Annotated[Job, Depends(job_or_404)]


def admit(svc: Services, samples: list[SampleIn], opt: JobOptions) -> JobCreated:
    """Tokenise, size against the spool budget, and queue what passes (or nothing, per ``on_invalid``).
    On the admission thread (``server/admission.py``), never the event loop."""
    s = svc.settings
    rows, bad = [], []
    for i, smp in enumerate(samples):
        try:
            t = svc.tokenizer(smp, opt)
        except SampleRefused as e:
            bad.append({"index": i, "id": smp.id, "reason": str(e)})
            continue
        n_pos = len(t.token_ids) + (opt.sampling.max_tokens if opt.mode == "regenerate" else 0)
        nbytes = svc.sizer.file_bytes(n_pos) or 0  # unknown yet: priced by the first notice (see Submitter)
        if nbytes > s.spool_budget_bytes:
            bad.append({"index": i, "id": smp.id, "reason": over_budget_reason(nbytes, s.spool_budget_bytes)})
            continue
        rows.append(NewSample(t.token_ids, t.loss_mask, t.label, nbytes))
    if bad and opt.on_invalid == "reject":
        raise HTTPException(422, {"message": f"{len(bad)} invalid sample(s); nothing was queued", "samples": bad})
    if not rows:
        raise HTTPException(422, {"message": "no valid sample in the job", "samples": bad})
    sampling = opt.sampling.model_dump() if opt.mode == "regenerate" else None
    warnings = ignored_keys_warnings(samples)
    created = svc.ledger.add_job(rows, epochs=opt.epochs, seed=opt.seed, sampling=sampling,
                                 meta={"options": opt.model_dump(), "rejected": bad, "warnings": warnings})  # fmt: skip
    return JobCreated(job_id=created.job_id, num_samples=created.num_samples, num_failed_at_submission=len(bad),
                      warnings=warnings)  # fmt: skip


def ignored_keys_warnings(samples: list[SampleIn]) -> list[str]:
    """One line per sample key that was ignored, with the number of samples that had it."""
    seen: Counter[str] = Counter(k for smp in samples for k in smp.ignored_keys)
    out = [f"ignored key {k[:80]!r} in {n} sample(s): not a sample field (id, prompt, messages, conversations, "
           "token_ids, tools)" for k, n in sorted(seen.items())[:20]]  # fmt: skip
    if len(seen) > 20:
        out.append(f"and {len(seen) - 20} more ignored keys")
    return out


@router.post("", response_model=JobCreated, dependencies=[Depends(expects("application/json"))])
async def create_job(job: JobIn, svc: ServicesDep) -> JobCreated:
    check_job_size(len(job.samples), job.options.epochs, svc.settings)
    await svc.submitter.probe_engine()  # the engine's length limit, if vLLM has answered by now
    created = await svc.admitter.run(admit, svc, job.samples, job.options)
    svc.submitter.wake()
    return created


@router.post("/upload", response_model=JobCreated, dependencies=[Depends(expects("multipart/form-data"))])
async def upload_job(svc: ServicesDep, file: UploadFile = File(...), options: str = Form("{}")) -> JobCreated:  # noqa: B008
    """The same records as ``POST /v1/jobs``, one JSON object per line."""
    try:
        opt = JobOptions.model_validate_json(options)
    except ValidationError as e:
        # without the input: it may hold what JSON cannot carry back (-Infinity, found by the fuzz test)
        errors = json.loads(e.json(include_input=False, include_url=False))
        raise HTTPException(422, {"message": "bad options", "errors": errors}) from e
    await file.seek(0)
    samples = await svc.admitter.run(read_jsonl, file, svc.settings)
    check_job_size(len(samples), opt.epochs, svc.settings)
    await svc.submitter.probe_engine()
    created = await svc.admitter.run(admit, svc, samples, opt)
    svc.submitter.wake()
    return created


def read_jsonl(file: UploadFile, s: Settings) -> list[SampleIn]:
    """An upload's records (on the admission thread: a big file takes a while to parse). The form
    parser spooled the file to disk as it arrived; it is read a line at a time, not whole, and
    no further than the job's sample limit (utf-8-sig: a leading BOM, as some editors write, is
    not part of the first line)."""
    samples, bad = [], []
    lines = io.TextIOWrapper(file.file, encoding="utf-8-sig", errors="replace", newline=None)
    for ln, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if len(samples) + len(bad) >= s.max_job_samples:
            raise too_many_samples(None, s)
        try:
            samples.append(SampleIn.model_validate_json(line))
        except ValidationError as e:
            bad.append({"line": ln, "reason": "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                        for x in e.errors())})  # fmt: skip
    if bad:
        raise HTTPException(422, {"message": f"{len(bad)} bad line(s) in {file.filename}", "lines": bad[:100]})
    if not samples:
        raise HTTPException(422, {"message": f"{file.filename} holds no records"})
    return samples


@router.get("", response_model=list[JobBrief])
async def list_jobs(svc: ServicesDep) -> list[JobBrief]:
    led = svc.ledger
    return [JobBrief(job_id=j.job_id, done=j.done, counts=j.counts(), compacted=j.compacted)
            for j in map(led.job_view, led.job_ids()) if j is not None]  # fmt: skip


@router.get("/{job_id}", response_model=JobStatus)
async def job_status(
    j: JobDep, svc: ServicesDep,
    errors_offset: int = Query(0, ge=0, lt=2**31), errors_limit: int = Query(100, ge=1, le=1000),
) -> JobStatus:  # fmt: skip
    elapsed = (j.finished or time.time()) - j.created
    page = svc.ledger.errors_page(j.job_id, errors_offset, errors_limit)  # an indexed read, not a scan
    return JobStatus(
        job_id=j.job_id, done=j.done, counts=j.counts(), num_samples=j.num_samples, compacted=j.compacted,
        tokens_consumed=j.tokens_consumed, bytes_consumed=j.bytes_consumed, elapsed_s=round(elapsed, 3),
        tokens_per_s=round(j.tokens_consumed / elapsed, 1) if elapsed > 0 else 0.0,
        errors=[SampleError(index=x.key.index, label=x.label, errors=x.errors) for x in page],
        errors_total=j.n_errors, errors_offset=errors_offset,
    )  # fmt: skip


@router.get("/{job_id}/token_counts", response_model=TokenCounts)
async def token_counts(j: JobDep, svc: ServicesDep) -> TokenCounts:
    if j.compacted:
        raise HTTPException(410, f"job {j.job_id!r} was compacted after HSSTREAM_JOB_RETENTION_S: its data is gone")
    c, total = await asyncio.to_thread(_count_tokens, svc, j.job_id)  # O(job): off the event loop
    return TokenCounts(job_id=j.job_id, vocab_size=svc.tokenizer.vocab_size, total_tokens=total, counts=dict(c))


def _count_tokens(svc: Services, job_id: str) -> tuple[Counter[int], int]:
    c: Counter[int] = Counter()
    total = 0
    for ids, mask in svc.ledger.iter_token_ids(job_id, epoch=0):
        mask = mask or [1] * len(ids)
        c.update(t for t, m in zip(ids, mask, strict=False) if m)
        total += len(ids)
    return c, total


@router.delete("/{job_id}", response_model=JobCancelled)
async def cancel_job(j: JobDep, svc: ServicesDep) -> JobCancelled:
    if j.compacted:
        raise HTTPException(409, f"job {j.job_id!r} finished and was compacted: nothing to cancel")
    files = await asyncio.to_thread(svc.ledger.cancel_job, j.job_id)  # O(job): off the event loop
    aborted = await svc.submitter.cancel_job(j.job_id)
    removed = svc.keeper.remove(files)
    return JobCancelled(job_id=j.job_id, cancelled=True, aborted_requests=aborted, removed_files=removed,
                        counts=svc.ledger.jobs[j.job_id].counts())  # fmt: skip
