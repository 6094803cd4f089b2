"""``GET /v1/overview``: the whole sidecar in one snapshot, for ``hsstream top``.

One call per refresh instead of one per job: a live view polls every second, and figures
taken from one snapshot add up (the states of the samples, the spool against its budget).
"""

from __future__ import annotations

import time
from collections import Counter

from connector.contract.rest import JobSummary, Overview, Rates, SpoolUsage
from server.dependencies import Services
from server.ledger import State

MAX_JOBS = 20


def overview(svc: Services) -> Overview:
    metrics = svc.metrics
    snap = svc.ledger.snapshot()  # one consistent view of the jobs, not torn by a transition
    summaries = [JobSummary(job_id=j.job_id, done=j.done, num_samples=j.num_samples, counts=j.counts)
                 for j in snap.jobs]  # fmt: skip
    states: Counter[str] = Counter({st.value: 0 for st in State})
    for js in summaries:
        states.update(js.counts)
    sps, tps = metrics.consumed.rates()
    down = svc.submitter.down_since
    return Overview(
        jobs_total=len(summaries),
        jobs_done=sum(js.done for js in summaries),
        jobs=summaries[::-1][:MAX_JOBS],
        samples=dict(states),
        ready=snap.ready,
        rates=Rates(window_s=metrics.consumed.window_s, samples_per_s=round(sps, 2), tokens_per_s=round(tps, 1)),
        spool=SpoolUsage(file_bytes=svc.keeper.file_bytes(), reserved_bytes=snap.reserved_bytes,
                         budget_bytes=svc.settings.spool_budget_bytes),
        trainers=svc.delivery.trainers(),
        vllm_down_since_s=None if down is None else round(time.monotonic() - down, 1),
    )
