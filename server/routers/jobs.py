"""Jobs: create (JSON or JSONL upload), list, status, token counts, cancel."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, HTTPException, Query, UploadFile
from pydantic import ValidationError

from connector.contract.holdout import held_out, sample_identity
from connector.contract.rest import (
    JobBrief,
    JobCancelled,
    JobCreated,
    JobIn,
    JobOptions,
    JobSample,
    JobSamples,
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
from server.ledger import ADD_BATCH, Job, NewSample
from server.model_shape import over_budget_reason

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_token)])
JobDep = Annotated[Job, Depends(job_or_404)]


#: Refused samples a job keeps by name (index, id, reason) in its 422 or its record; the rest
#: are counted per reason, so a job of a million bad rows costs a counter, not a list.
KEEP_REFUSED = 100


def admit(svc: Services, samples: Iterable[SampleIn], opt: JobOptions,
          after_read: Callable[[], None] | None = None, records: JsonlRecords | None = None) -> JobCreated:  # fmt: skip
    """Tokenise, size against the spool budget, and queue what passes (or nothing, per ``on_invalid``).
    On the admission thread (``server/admission.py``), never the event loop. The rows are staged
    in the ledger a batch at a time as they are tokenised, so memory holds a batch, not the job;
    until the job is queued whole (``JobWriter.commit``) nothing of it is submitted, and a job
    refused on the way is dropped. ``after_read``: called once ``samples`` is exhausted, before
    the job's own checks; what it raises refuses the job. ``records``: an upload's lines, whose
    unreadable ones ``on_invalid: skip`` counts as skipped too."""
    s = svc.settings
    sampling = opt.sampling.model_dump() if opt.mode == "regenerate" else None
    job = svc.ledger.begin_job(sampling=sampling)
    bad: list[dict] = []
    skipped: Counter[str] = Counter()
    repaired: Counter[str] = Counter()
    ignored: Counter[str] = Counter()

    def refuse(entry: dict, reason: str) -> None:
        skipped[reason] += 1
        if len(bad) < KEEP_REFUSED:
            bad.append(entry)

    try:
        chunk: list[NewSample] = []
        for i, smp in enumerate(samples):
            ignored.update(smp.ignored_keys)
            try:
                t = svc.tokenizer(smp, opt)
            except SampleRefused as e:
                refuse({"index": i, "id": smp.id, "reason": str(e)}, e.reason)
                continue
            n_pos = len(t.token_ids) + (opt.sampling.max_tokens if opt.mode == "regenerate" else 0)
            nbytes = svc.sizer.file_bytes(n_pos) or 0  # unknown yet: priced by the first notice (see Submitter)
            if nbytes > s.spool_budget_bytes:
                refuse({"index": i, "id": smp.id, "reason": over_budget_reason(nbytes, s.spool_budget_bytes)},
                       "over the spool budget")  # fmt: skip
                continue
            repaired.update(t.repairs)
            chunk.append(NewSample(t.token_ids, t.loss_mask, t.label, nbytes))
            if len(chunk) >= ADD_BATCH:
                job.stage(chunk)
                chunk = []
        job.stage(chunk)
        if after_read is not None:
            after_read()
        if records is not None and records.n_bad:
            skipped[INVALID_ROW] += records.n_bad
            bad.extend(records.bad[: max(0, KEEP_REFUSED - len(bad))])
        n_bad = sum(skipped.values())
        if n_bad and opt.on_invalid == "reject":
            raise HTTPException(422, {"message": f"{n_bad} invalid sample(s); nothing was queued "
                                                 "(on_invalid: skip queues the others)",
                                      "skipped": dict(skipped), "samples": bad})  # fmt: skip
        if not job.n:
            raise HTTPException(422, {"message": "no valid sample in the job", "skipped": dict(skipped),
                                      "samples": bad})  # fmt: skip
    except BaseException:
        job.drop()
        raise
    warnings = ignored_keys_warnings(ignored) + counted_warnings("skipped", skipped) + counted_warnings(
        "repaired", repaired, what="ShareGPT conversation(s)")  # fmt: skip
    created = job.commit(epochs=opt.epochs, seed=opt.seed,
                         meta={"options": opt.model_dump(), "rejected": bad, "skipped": dict(skipped),
                               "repaired": dict(repaired), "warnings": warnings})  # fmt: skip
    return JobCreated(job_id=created.job_id, num_samples=created.num_samples, num_failed_at_submission=n_bad,
                      warnings=warnings, skipped=dict(skipped), repaired=dict(repaired))  # fmt: skip


#: The reason an upload's line that is no sample (not JSON, not a sample's shape) is counted under.
INVALID_ROW = "invalid row"


def counted_warnings(verb: str, seen: Counter[str], what: str = "sample(s)", most: int = 20) -> list[str]:
    """One line per reason, most frequent first: ``skipped 126 sample(s): empty conversation``."""
    top = seen.most_common()
    out = [f"{verb} {n:,} {what}: {k}" for k, n in top[:most]]
    if len(top) > most:
        out.append(f"{verb} {sum(n for _, n in top[most:]):,} more {what} for {len(top) - most} other reasons")
    return out


def ignored_keys_warnings(seen: Counter[str]) -> list[str]:
    """One line per sample key that was ignored, with the number of samples that had it."""
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
    """The same records as ``POST /v1/jobs``, one JSON object per line, admitted as they are read."""
    try:
        opt = JobOptions.model_validate_json(options)
    except ValidationError as e:
        # without the input: it may hold what JSON cannot carry back (-Infinity, found by the fuzz test)
        errors = json.loads(e.json(include_input=False, include_url=False))
        raise HTTPException(422, {"message": "bad options", "errors": errors}) from e
    await file.seek(0)
    await svc.submitter.probe_engine()
    records = JsonlRecords(file, svc.settings, opt.epochs, skip_bad=opt.on_invalid == "skip")
    created = await svc.admitter.run(admit, svc, records, opt, records.check, records)
    svc.submitter.wake()
    return created


class JsonlRecords:
    """An upload's records, read a line at a time as admission asks for them (on the admission
    thread). The form parser spooled the file to disk as it arrived. Reading stops at the job's
    sample limit (413); every line is read otherwise, so :meth:`check` can list all the bad ones,
    but records past the row limit (samples x epochs) are only counted, not handed on: the job
    is refused anyway, by :meth:`check`. A line that is no sample (not JSON, not a sample's
    shape) refuses the job, unless ``skip_bad`` (``on_invalid: skip``): then it is counted
    (``n_bad``, the first ones named in ``bad``) and the others go on. utf-8-sig: a leading BOM,
    as some editors write, is not part of the first line."""

    def __init__(self, file: UploadFile, s: Settings, epochs: int, *, skip_bad: bool = False) -> None:
        self.file, self.s, self.epochs, self.skip_bad = file, s, epochs, skip_bad
        self.count = 0
        self.n_bad = 0
        self.bad: list[dict] = []  # the first KEEP_REFUSED

    def __iter__(self) -> Iterator[SampleIn]:
        s = self.s
        lines = io.TextIOWrapper(self.file.file, encoding="utf-8-sig", errors="replace", newline=None)
        for ln, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if self.count + self.n_bad >= s.max_job_samples:
                raise too_many_samples(None, s)
            try:
                smp = SampleIn.model_validate_json(line)
            except ValidationError as e:
                self.n_bad += 1
                if len(self.bad) < KEEP_REFUSED:
                    self.bad.append({"line": ln, "reason": "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                                     for x in e.errors())})  # fmt: skip
                continue
            self.count += 1
            if (self.skip_bad or not self.n_bad) and self.count * self.epochs <= s.max_job_rows:
                yield smp

    def check(self) -> None:
        """Once read: 422 for bad lines (unless skipped) or no record, 413 for a job over the row limit."""
        if self.n_bad and not self.skip_bad:
            raise HTTPException(422, {"message": f"{self.n_bad} bad line(s) in {self.file.filename}",
                                      "lines": self.bad})  # fmt: skip
        if not self.count:
            raise HTTPException(422, {"message": f"{self.file.filename} holds no records"
                                                 + (f" ({self.n_bad} bad line(s))" if self.n_bad else ""),
                                      "lines": self.bad})  # fmt: skip
        check_job_size(self.count, self.epochs, self.s)


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
    meta = svc.ledger.job_meta(j.job_id)  # one row by its key
    return JobStatus(
        job_id=j.job_id, done=j.done, counts=j.counts(), num_samples=j.num_samples, compacted=j.compacted,
        tokens_consumed=j.tokens_consumed, bytes_consumed=j.bytes_consumed, elapsed_s=round(elapsed, 3),
        tokens_per_s=round(j.tokens_consumed / elapsed, 1) if elapsed > 0 else 0.0,
        errors=[SampleError(index=x.key.index, label=x.label, errors=x.errors) for x in page],
        errors_total=j.n_errors, errors_offset=errors_offset,
        skipped=meta.get("skipped") or {}, warnings=meta.get("warnings") or [],
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


#: Tokens a page of ``GET /v1/jobs/{id}/samples`` returns at most (a first sample whatever its
#: length): the answer's size is bounded in bytes, not only in samples (~6 MB of JSON).
SAMPLES_PAGE_TOKENS = 1_000_000


@router.get("/{job_id}/samples", response_model=JobSamples)
async def job_samples(
    j: JobDep, svc: ServicesDep, offset: int = Query(0, ge=0, lt=2**31), limit: int = Query(100, ge=1, le=1000),
    eval_fraction: float | None = Query(None, ge=0.0, lt=1.0, description="only the samples "
                                        "connector/contract/holdout.py holds out at this fraction"),
    eval_seed: int = Query(0, ge=-(2**63), lt=2**63, description="with eval_fraction: the split's seed"),
) -> JobSamples:  # fmt: skip
    """A page of the job's samples (epoch 0, index order): token ids, loss masks, ids. What
    ``hsstream eval --job`` prompts with. ``limit`` rows are looked at per call (≤ 1000) and at
    most ``SAMPLES_PAGE_TOKENS`` tokens returned; ``next_offset`` says where to go on. Read and
    built off the event loop."""
    if j.compacted:
        raise HTTPException(410, f"job {j.job_id!r} was compacted after HSSTREAM_JOB_RETENTION_S: its data is gone")
    pick = None
    if eval_fraction is not None:
        def pick(label: str | None, index: int) -> bool:
            return held_out(sample_identity(label, index), eval_fraction, eval_seed)
    regenerate = j.sampling is not None

    def page() -> JobSamples:
        rows, nxt, n = svc.ledger.samples_page(j.job_id, offset, limit, max_tokens=SAMPLES_PAGE_TOKENS, pick=pick)
        return JobSamples(job_id=j.job_id, num_samples=n, offset=offset, next_offset=nxt, samples=[
            JobSample(index=i, id=label, token_ids=ids, loss_mask=mask,
                      prompt_len=plen if regenerate and plen is not None and plen >= 0 else None)
            for i, label, ids, mask, plen in rows
        ])  # fmt: skip

    return await asyncio.to_thread(page)


@router.delete("/{job_id}", response_model=JobCancelled)
async def cancel_job(
    j: JobDep, svc: ServicesDep,
    purge: bool = Query(False, description="also delete the job's samples (token ids, labels) now, as compaction "
                        "does after HSSTREAM_JOB_RETENTION_S; its counts stay"),
) -> JobCancelled:  # fmt: skip
    if j.compacted:
        if purge:  # its data is gone already: purging it again is done
            return JobCancelled(job_id=j.job_id, cancelled=False, aborted_requests=0, removed_files=0,
                                counts=j.counts(), purged=True)  # fmt: skip
        raise HTTPException(409, f"job {j.job_id!r} finished and was compacted: nothing to cancel")
    files = await asyncio.to_thread(svc.ledger.cancel_job, j.job_id)  # O(job): off the event loop
    aborted = await svc.submitter.cancel_job(j.job_id)
    removed = svc.keeper.remove(files)
    counts = svc.ledger.jobs[j.job_id].counts()
    purged = await asyncio.to_thread(svc.ledger.purge, j.job_id) if purge else False
    return JobCancelled(job_id=j.job_id, cancelled=True, aborted_requests=aborted, removed_files=removed,
                        counts=counts, purged=purged)  # fmt: skip
