"""The tee: finished requests into the sidecar's traffic jobs, off the response path.

The event loop only appends a finished request's bytes to a bounded queue (:meth:`Tee.offer`,
no parsing, no I/O); past its bound the newest is dropped and counted, so neither a slow nor a
dead sidecar can delay or fail a client. One thread (``hsstream-tee``) takes them: builds the
sample (``samples.py``), de-duplicates it by content hash, holds out a share for the swap's
gate, applies the per-minute cap, and every ``flush_s`` seconds (or ``flush_samples`` samples)
uploads what it has as one traffic job per chat-template option set through
:class:`~connector.contract.rest_client.SidecarClient` (so auth is the sidecar's, whatever it
asks for). A sidecar that does not answer, or that already holds ``max_backlog`` queued
samples, has the batch dropped and counted; its hashes are forgotten, so the same
conversation can be teed when it comes again.

The trainer follows the traffic jobs as every job of its sidecar (``hsstream train --follow``),
so "the continuous traffic job" is this series of small jobs: each one is admitted, produced,
consumed and compacted by the sidecar like any other, and the proxy's store lists them so that
``hsstream proxy forget`` can purge them.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from connector.contract.holdout import held_out
from hsstream.proxy import samples as S
from hsstream.proxy.metrics import ProxyMetrics
from hsstream.proxy.settings import ProxySettings
from hsstream.proxy.store import TeedStore

log = logging.getLogger("hsstream.proxy")

#: samples.NotTeed reasons that are "unsupported" (the rest are "unparsable").
_UNSUPPORTED = {"token_or_batched_prompt", "echo", "no_messages", "route", "empty"}


@dataclass(frozen=True)
class TeeRecord:
    route: str  # "chat" | "completions"
    request: bytes
    reply: bytes


class Tee:
    def __init__(self, s: ProxySettings, store: TeedStore, metrics: ProxyMetrics,
                 client_factory: Callable[[], object] | None = None, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.s, self.store, self.m = s, store, metrics
        self._client_factory = client_factory or self._sidecar_client
        self._clock = clock
        self._q: collections.deque[TeeRecord] = collections.deque()
        self._q_bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: dict[str, list[S.TeeSample]] = {}
        self._n_pending = 0
        self._last_flush = clock()
        self._last_prune = 0.0
        self._minute: collections.deque[float] = collections.deque()
        self._client = None
        self._thread = threading.Thread(target=self._run, name="hsstream-tee", daemon=True)
        self.flushes = 0

    # ------------------------------------------------------------------ the event loop's side
    def count(self, outcome: str) -> None:
        self.m.tee.labels(outcome).inc()

    def offer(self, rec: TeeRecord) -> None:
        """Queue a finished request, or drop it (counted) when the queue is full. Never blocks."""
        n = len(rec.request) + len(rec.reply)
        with self._lock:
            if len(self._q) >= self.s.queue_max or self._q_bytes + n > self.s.queue_max_bytes:
                full = True
            else:
                full = False
                self._q.append(rec)
                self._q_bytes += n
        if full:
            self.count("queue_full")
            return
        self.m.tee_queue.inc()
        self._wake.set()

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the thread after it took what is queued and sent what it holds (best effort)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _sidecar_client(self) -> object:
        from connector.contract.rest_client import SidecarClient

        return SidecarClient(self.s.sidecar(), token=None, timeout=10.0)

    def _run(self) -> None:
        try:
            while True:
                stopping = self._stop.is_set()
                self._wake.wait(timeout=max(0.05, min(1.0, self.s.flush_s)))
                self._wake.clear()
                self._drain()
                due = self._clock() - self._last_flush >= self.s.flush_s
                if self._n_pending and (due or self._n_pending >= self.s.flush_samples or stopping):
                    self._flush()
                elif due:
                    self._last_flush = self._clock()
                if self._clock() - self._last_prune >= 60.0:
                    self._prune()
                if stopping:
                    return
        except Exception:  # never silently: the tee stops, the proxy serves on
            log.exception("the tee's thread failed; requests are no longer teed")
        finally:
            if self._client is not None:
                self._client.close()  # type: ignore[attr-defined]

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._q:
                    return
                rec = self._q.popleft()
                self._q_bytes -= len(rec.request) + len(rec.reply)
            self.m.tee_queue.dec()
            try:
                self._take(rec)
            except Exception:  # one bad record never stops the tee
                log.exception("tee: a record could not be taken")
                self.count("unparsable")

    def _take(self, rec: TeeRecord) -> None:
        try:
            smp = S.build(rec.route, rec.request, rec.reply)
        except S.NotTeed as e:
            self.count("unsupported" if str(e) in _UNSUPPORTED else "unparsable")
            return
        if not self.store.remember(smp.digest):
            self.count("duplicate")
            return
        if held_out(smp.label, self.s.holdout_fraction, self.s.holdout_seed):
            self.store.hold_out(smp.digest, smp.prompt, smp.options_key)
            self.count("held_out")
            return
        now = self._clock()
        while self._minute and now - self._minute[0] >= 60.0:
            self._minute.popleft()
        if len(self._minute) >= self.s.max_per_minute:
            self.store.forget_digest(smp.digest)
            self.count("capped")
            return
        self._minute.append(now)
        self._pending.setdefault(smp.options_key, []).append(smp)
        self._n_pending += 1

    def _drop(self, batch: list[S.TeeSample], outcome: str) -> None:
        for smp in batch:
            self.store.forget_digest(smp.digest)
        self.m.tee.labels(outcome).inc(len(batch))

    def _flush(self) -> None:
        from connector.contract.rest_client import SidecarError

        batch, self._pending, self._n_pending = self._pending, {}, 0
        self._last_flush = self._clock()
        self.flushes += 1
        try:
            if self._client is None:
                self._client = self._client_factory()
            c = self._client
            if self.s.max_backlog:
                queued = c.overview().samples.get("queued", 0)  # type: ignore[attr-defined]
                if queued >= self.s.max_backlog:
                    log.warning("tee: the sidecar holds %d queued samples (max %d): %d teed samples dropped",
                                queued, self.s.max_backlog, sum(map(len, batch.values())))  # fmt: skip
                    for smps in batch.values():
                        self._drop(smps, "backlog")
                    return
        except SidecarError as e:
            log.warning("tee: the sidecar did not answer (%s): %d teed samples dropped", e,
                        sum(map(len, batch.values())))  # fmt: skip
            for smps in batch.values():
                self._drop(smps, "sidecar_down" if e.unreachable else "refused")
            return
        for key, smps in batch.items():
            opts: dict = {"loss_mask": "assistant", "on_invalid": "skip"}
            if key:
                opts["chat_template_kwargs"] = json.loads(key)
            try:
                created = c.upload([x.as_row() for x in smps], opts, filename="traffic.jsonl")  # type: ignore[attr-defined]
            except SidecarError as e:
                log.warning("tee: the sidecar %s a traffic job of %d samples: %s",
                            "did not take" if e.unreachable else "refused", len(smps), str(e)[:300])  # fmt: skip
                self._drop(smps, "sidecar_down" if e.unreachable else "refused")
                continue
            self.store.add_job(created.job_id, created.num_samples, key)
            self.m.tee.labels("teed").inc(created.num_samples)
            if created.num_failed_at_submission:
                self.m.tee.labels("refused").inc(created.num_failed_at_submission)

    def _prune(self) -> None:
        from connector.contract.rest_client import SidecarError

        self._last_prune = self._clock()
        gone = self.store.prune()
        for j in gone["expired_jobs"]:
            try:
                if self._client is None:
                    self._client = self._client_factory()
                purge_job(self._client, j["job_id"])
            except SidecarError as e:
                if e.status != 404:  # the sidecar forgot it already: nothing to purge
                    log.warning("tee: traffic job %s past the retention could not be purged: %s", j["job_id"], e)
                    continue
            self.store.drop_job(j["job_id"])


def purge_job(client: object, job_id: str) -> None:
    """Cancel a traffic job and delete its rows in the sidecar (``DELETE /v1/jobs/{id}?purge=true``)."""
    client.cancel(job_id, purge=True)  # type: ignore[attr-defined]
