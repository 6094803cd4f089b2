"""Sends queued samples to vLLM, one prompt per ``/v1/completions`` call.

One prompt per call because vLLM returns ``kv_transfer_params`` only for the first prompt of
a multi-prompt request. Token ids, not text, and ``max_tokens=1``: we only want the prefill's
hidden states. The spool budget is enforced here, before a request exists: a sample is only
submitted once its expected bytes fit.

Two limits are only known once things run, and both are applied here too: the engine's
``max_model_len`` (read from vLLM's ``/v1/models``; queued samples longer than it fail at
once, spending no attempt) and, when the verifier's config could not be read, the sample
size (learned from the first notice; until then one sample at a time is in flight).

vLLM going away is expected (restarts, upgrades): while it is unreachable, samples wait
with exponential backoff and keep their attempts; only past ``down_deadline_s`` of
continuous unavailability are they failed, with the reason.

Several engines (``HSSTREAM_VLLM_URL`` as a comma-separated list: vLLM processes on one or
more hosts, each with our connector, the same spool and notice endpoint) share the queue:
each sample goes to the least-loaded engine that is up (fewest requests outstanding), so a
slow engine gets fewer. Each engine is probed and declared down on its own: a request to an
engine that fails to connect or dies mid-request is re-queued without spending an attempt
and goes to another; the samples that engine had answered but whose file had not arrived
yet are re-queued at once (its writer died with it) instead of after the notice timeout.
Samples wait only while every engine is down, and fail only past the deadline of all of them
being down.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from connector import protocol as P
from server.ledger import Ledger, SampleRow, State
from server.ledger_calls import ledger_call
from server.model_shape import SampleSizer, over_budget_reason, too_long_reason
from server.vllm_http import AiohttpClient, Http, HttpError, TimedOut, Unreachable

log = logging.getLogger("hsstream.sidecar")


#: How long a filesystem found with room is trusted (at 500 samples/s of 16 KiB, 160 KiB in
#: 20 ms, against a 64 MiB reserve).
FS_CHECK_S = 0.02


class VllmUnavailable(RuntimeError):
    pass


def parse_engine_urls(urls: str | list[str]) -> list[str]:
    """The engines' base URLs from ``HSSTREAM_VLLM_URL`` (one, or a comma-separated list)."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip().rstrip("/") for u in items if u.strip()]
    if not out:
        raise ValueError("no vLLM URL (HSSTREAM_VLLM_URL): give one, or several separated by commas")
    bad = [u for u in out if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"HSSTREAM_VLLM_URL: {', '.join(map(repr, bad))} is not an http(s):// URL")
    if len(set(out)) != len(out):
        raise ValueError(f"HSSTREAM_VLLM_URL names an engine twice: {out}")
    return out


@dataclass(eq=False)
class Engine:
    """One vLLM engine as the submitter sees it. Only the event loop touches it."""

    url: str
    model_name: str | None = None  # the served model name, once it answered /v1/models
    max_model_len: int | None = None
    down_since: float | None = None  # monotonic time of the failure that took it down
    in_flight: int = 0  # requests sent, not yet answered
    requests: int = 0
    failures: int = 0  # requests that found it unreachable
    #: Samples it answered whose notice has not come: key -> attempt. If it dies, their files
    #: will not come either (the writer thread died with it).
    answered: dict[P.SampleKey, int] = field(default_factory=dict)

    @property
    def up(self) -> bool:
        return self.down_since is None

    def describe(self) -> dict:
        return {"url": self.url, "up": self.up, "model": self.model_name, "max_model_len": self.max_model_len,
                "in_flight": self.in_flight, "requests": self.requests, "failures": self.failures,
                "down_for_s": None if self.up else round(time.monotonic() - self.down_since, 1)}  # fmt: skip


def epoch_seed(seed: int, epoch: int) -> int:
    """The sampling seed of a regenerated reply in ``epoch``: the job's own in epoch 0, another
    one each later epoch (the same every time), so that each epoch draws a fresh reply — the
    point of regenerating every epoch — and a rerun of the job draws the same ones. vLLM takes
    any int64; a later epoch's seed is in [0, 2**63)."""
    return seed if epoch == 0 else (seed + epoch * 0x9E3779B97F4A7C15) % 2**63


def least_loaded(engines: list[Engine], start: int = 0) -> Engine | None:
    """The engine that is up with the fewest requests outstanding; ties go to the first from
    ``start`` on (the caller rotates it, so equal engines take turns). None if all are down."""
    n = len(engines)
    best: Engine | None = None
    for i in range(n):
        e = engines[(start + i) % n]
        if e.up and (best is None or e.in_flight < best.in_flight):
            best = e
    return best


class Submitter:
    def __init__(
        self,
        ledger: Ledger,
        vllm_url: str | list[str],
        *,
        budget_bytes: int,
        max_ready: int | None = None,
        concurrency: int = 16,
        timeout_s: float = 600.0,
        down_deadline_s: float = 600.0,
        notice_timeout_s: float = 120.0,
        spool_dir: str | None = None,
        fs_reserve_bytes: int = 64 * 2**20,
        sizer: SampleSizer | None = None,
        client: Http | None = None,
        on_latency: Callable[[float], object] | None = None,
        on_engine_limit: Callable[[int], object] | None = None,
        wake_delivery: Callable[[], None] | None = None,
    ) -> None:
        """``on_latency``: told each vLLM request's seconds (the metrics); ``on_engine_limit``:
        told vLLM's max_model_len once an engine answers (admission); ``wake_delivery``: rung
        when vLLM's reply made a sample READY (regenerate mode), so the delivery thread offers
        it at once."""
        self.ledger = ledger
        self.engines = [Engine(u) for u in parse_engine_urls(vllm_url)]
        self._turn = 0  # where least_loaded starts looking: equal engines take turns
        self.budget = budget_bytes
        self.max_ready = max_ready
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.down_deadline_s = down_deadline_s
        self.notice_timeout_s = notice_timeout_s
        self.spool_dir = spool_dir
        self.fs_reserve_bytes = fs_reserve_bytes
        self._fs_ok_at = -1.0  # monotonic time the filesystem last had room
        self.engine_max_len: int | None = None  # the smallest max_model_len of the engines that answered
        self.on_engine_limit = on_engine_limit
        self.on_latency = on_latency
        self.wake_delivery = wake_delivery
        self.sizer = sizer
        ledger.pricer = self._price  # a retried sample is priced by what is known now (a refusal may have taught it)
        self._given_client = client  # a fake vLLM in unit tests; else aiohttp, made in start()
        self._applied: tuple[int, int | None] = (-1, None)  # (sizer version, engine limit) applied to the queue
        self.in_flight = 0  # SUBMITTED samples, kept by this ledger listener (on the thread of each move)
        ledger.listeners.append(self._on_transition)
        self.last_notice_timeout_at: float | None = None  # monotonic; readyz compares it with the last notice
        self.stats = {"requests": 0, "http_errors": 0, "vllm_down_retries": 0, "notice_timeouts": 0,
                      "submitted_before_size_known": 0, "max_in_flight_before_size_known": 0,
                      "failed_over_engine_limit": 0, "requeued_engine_lost": 0}  # fmt: skip
        self._client: Http | None = client
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._probe: asyncio.Task | None = None
        self._probes: dict[str, asyncio.Task] = {}  # engine url -> task probing it back
        self._checks: dict[str, asyncio.Task] = {}  # engine url -> liveness check while it owes files
        self._wake = asyncio.Event()
        self._inflight: dict[P.SampleKey, asyncio.Task] = {}

    async def start(self) -> None:
        self._stopping = False
        if self._given_client is None:  # aiohttp's session must be made inside the running loop
            self._client = AiohttpClient(self.timeout_s, max_connections=self.concurrency + 16)
        self._task = asyncio.create_task(self._loop())
        self._probe = asyncio.create_task(self._probe_engine_until_known())

    @property
    def url(self) -> str:
        """The engines' URLs, for messages (one engine: its URL)."""
        return ", ".join(e.url for e in self.engines)

    @property
    def down_since(self) -> float | None:
        """Since when every engine has been down (None while one is up): samples wait meanwhile."""
        if any(e.up for e in self.engines):
            return None
        return max(e.down_since for e in self.engines)  # type: ignore[type-var]

    async def stop(self) -> None:
        # Python 3.11's asyncio.wait_for can swallow a cancellation that lands as its inner wait
        # ends (fixed in 3.12): the loops below also end on this flag, so a lost cancel cannot
        # keep them polling and this gather waiting forever.
        self._stopping = True
        tasks = [t for t in (self._task, self._probe, *self._probes.values(), *self._checks.values(),
                             *self._inflight.values()) if t]  # fmt: skip
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client:
            await self._client.aclose()

    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def wake(self) -> None:
        self._wake.set()

    async def cancel_job(self, job_id: str) -> int:
        """Abort a job's requests in vLLM: closing the HTTP request makes vLLM abort it."""
        tasks = [t for k, t in self._inflight.items() if k.job == job_id]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    async def engine_model(self, e: Engine, timeout: float = 5.0) -> str:
        """An engine's served model name (asked once; vLLM rejects requests naming another)."""
        if e.model_name is None:
            assert self._client is not None
            try:
                r = await self._client.get(f"{e.url}/v1/models", timeout=timeout)
                if r.status_code >= 400:
                    raise HttpError(f"/v1/models answered {r.status_code}: {r.text[:300]}")
                card = r.json()["data"][0]
                name = card["id"]
            except (HttpError, KeyError, IndexError, ValueError, TypeError) as exc:
                raise VllmUnavailable(f"vLLM at {e.url} is not reachable: {exc!r}") from exc
            e.model_name = name
            n = card.get("max_model_len")
            if isinstance(n, int) and n > 0 and n != e.max_model_len:
                e.max_model_len = n
                self._set_engine_limit()
        return e.model_name

    async def vllm_model(self, timeout: float = 5.0) -> str:
        """The served model name of an engine that answers (readiness: at least one does)."""
        errors = []
        for e in self.engines:
            try:
                return await self.engine_model(e, timeout)
            except VllmUnavailable as exc:
                errors.append(str(exc))
        raise VllmUnavailable("; ".join(errors))

    def _set_engine_limit(self) -> None:
        """Admission uses the smallest limit of the engines known: a sample fits any engine."""
        known = [e.max_model_len for e in self.engines if e.max_model_len]
        n = min(known) if known else None
        if n is None or n == self.engine_max_len:
            return
        log.info("vLLM serves at most %d tokens per sequence (max_model_len%s): longer samples are refused", n,
                 "" if len(self.engines) == 1 else ", the smallest of the engines that answered")  # fmt: skip
        self.engine_max_len = n
        if self.on_engine_limit:
            self.on_engine_limit(n)
        self.wake()  # the submit loop applies it to the queue (a thread: O(queue)) before its next submission

    async def probe_engine(self, timeout: float = 2.0) -> int | None:
        """vLLM's max_model_len, asking the engines not heard from yet; None while none answered."""
        if self._client is not None:
            for e in self.engines:
                if e.max_model_len is None:
                    try:
                        e.model_name = None
                        await self.engine_model(e, timeout)
                    except VllmUnavailable:
                        pass
        return self.engine_max_len

    async def _probe_engine_until_known(self) -> None:
        """Learn every engine's limit as soon as it answers, not only once a job needs it."""
        while any(e.max_model_len is None for e in self.engines) and not self._stopping:
            await self.probe_engine()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ engines up and down
    def _engine_down(self, e: Engine, why: object) -> None:
        """A request found ``e`` unreachable: stop sending to it, probe it until it is back, and
        re-queue what it answered but never delivered (its writer died with it)."""
        e.failures += 1
        e.model_name = None
        if e.up:
            e.down_since = time.monotonic()
            others = sum(x.up for x in self.engines)
            log.warning("vLLM at %s unreachable (%r): %s", e.url, why,
                        f"sending to the {others} other engine(s)" if others else "holding submissions until it is back")  # fmt: skip
        lost, e.answered = e.answered, {}
        for key, attempt in lost.items():
            smp = self.ledger.get(key)
            if smp is None or smp.state != State.submitted or smp.attempt != attempt or smp.notice is not None:
                continue  # its file came after all
            self.stats["requeued_engine_lost"] += 1
            self.ledger.requeue(key, attempt, f"vLLM at {e.url} went away before the sample's file arrived",
                                count_attempt=False)  # fmt: skip
        if e.url not in self._probes or self._probes[e.url].done():
            self._probes[e.url] = asyncio.create_task(self._probe_until_back(e))

    async def _probe_until_back(self, e: Engine) -> None:
        while not e.up and not self._stopping:
            try:
                e.model_name = None
                await self.engine_model(e, timeout=5.0)
            except VllmUnavailable:
                await asyncio.sleep(1.0)
                continue
            log.info("vLLM at %s is back after %.0f s", e.url, time.monotonic() - (e.down_since or time.monotonic()))
            e.down_since = None
            self.wake()

    def _forget_delivered(self) -> None:
        """Drop answered samples whose file came (or that moved on): only the rest are at risk.
        An engine that still owes files is asked for ``/health``: one that died with no request
        of ours in flight is noticed in a second, not after the notice timeout."""
        for e in self.engines:
            for key, attempt in list(e.answered.items()):
                s = self.ledger.get(key)
                if s is None or s.state != State.submitted or s.attempt != attempt or s.notice is not None:
                    del e.answered[key]
            if e.up and e.answered and (e.url not in self._checks or self._checks[e.url].done()):
                self._checks[e.url] = asyncio.create_task(self._check_alive(e))

    async def _check_alive(self, e: Engine) -> None:
        """Only a refused or broken connection counts as death here: a slow answer from a busy
        engine does not (its requests have their own timeout)."""
        assert self._client is not None
        try:
            await self._client.get(f"{e.url}/health", timeout=10.0)
        except Unreachable as exc:
            self._engine_down(e, exc)
        except HttpError:
            pass

    # ------------------------------------------------------------------ limits
    def _on_transition(self, new: State, old: State | None, n: int, _tokens: int) -> None:
        self.in_flight += n * ((new == State.submitted) - (old == State.submitted))

    def _room(self, s: SampleRow) -> int:
        """Tokens vLLM generates beyond the prompt: 1, or the regenerated reply."""
        sampling = self.ledger.jobs[s.key.job].sampling
        return int(sampling.get("max_tokens") or 1) if sampling is not None else 1

    def _too_long(self, s: SampleRow) -> str | None:
        if self.engine_max_len is None or (s.generated and self.ledger.jobs[s.key.job].sampling is not None):
            return None
        if len(s.token_ids) + self._room(s) <= self.engine_max_len:
            return None
        return too_long_reason(len(s.token_ids), self.engine_max_len, self._room(s), "vLLM's max_model_len")

    def _price(self, s: SampleRow) -> int | None:
        """A sample's spool bytes by the sample size known now (None: not known yet)."""
        job = self.ledger.jobs.get(s.key.job)
        if self.sizer is None or not self.sizer.known or job is None:
            return None
        return self.sizer.file_bytes(len(s.token_ids) + (self._room(s) if job.sampling is not None else 0))

    def _limits_changed(self) -> bool:
        return ((self.sizer.version if self.sizer else 0), self.engine_max_len) != self._applied

    def _apply_limits(self) -> None:
        """Apply a newly known sample size or engine limit to the samples already queued."""
        version = self.sizer.version if self.sizer else 0
        if (version, self.engine_max_len) == self._applied:
            return
        if self.sizer is not None and self.sizer.known and version != self._applied[0]:
            n = self.ledger.reprice_queued(lambda s: self._price(s) or 0)
            log.info("sample size %s: %d queued sample(s) priced again", self.sizer.describe(), n)
            self.ledger.fail_queued(lambda s: over_budget_reason(s.expected_bytes, self.budget)
                                    if s.expected_bytes > self.budget else None)  # fmt: skip
        if self.engine_max_len is not None and self.engine_max_len != self._applied[1]:
            self.stats["failed_over_engine_limit"] += self.ledger.fail_queued(self._too_long)
        self._applied = (version, self.engine_max_len)

    def _sized(self) -> bool:
        """Queued samples carry prices from a known size (learning happens on another thread:
        a size learned but not yet applied to the queue does not count)."""
        return self.sizer is None or (self.sizer.known and self._applied[0] == self.sizer.version)

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self._loop_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the submit loop must outlive one bad pass
                log.exception("submit loop failed; restarting it")
                await asyncio.sleep(1.0)

    async def _loop_once(self) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        last_sweep = time.monotonic()
        while not self._stopping:
            if time.monotonic() - last_sweep > 1.0 and self.ledger.try_lock():  # busy: the next pass sweeps
                last_sweep = time.monotonic()
                try:
                    reason = self._sweep()
                finally:
                    self.ledger.unlock()
                if reason:
                    await asyncio.to_thread(self.fail_queued, reason)  # O(queue): never on the event loop
            if self.down_since is not None:
                # Every engine is away: their probes will wake us; burn no requests meanwhile.
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                continue
            await sem.acquire()
            if self._limits_changed():
                await asyncio.to_thread(self._apply_limits)  # O(queue): never on the event loop
            sized = self._sized()
            # size unknown: one sample at a time, its notice will tell the size
            ok = self._fs_has_room() and (sized or self.in_flight == 0)
            s = await ledger_call(self.ledger, self.ledger.next_to_submit, self.budget, self.max_ready) if ok else None
            if s is not None and not sized:
                self.stats["submitted_before_size_known"] += 1
                self.stats["max_in_flight_before_size_known"] = max(self.stats["max_in_flight_before_size_known"],
                                                                     self.in_flight)  # fmt: skip
            if s is None:
                sem.release()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
                continue
            engine = least_loaded(self.engines, self._turn)
            if engine is None:  # went down while we waited for the semaphore: back to the queue
                self.ledger.requeue(s.key, s.attempt, "every vLLM engine is unreachable", count_attempt=False)
                sem.release()
                continue
            self._turn = (self.engines.index(engine) + 1) % len(self.engines)
            engine.in_flight += 1
            t = asyncio.create_task(self._submit(s, sem, engine))
            self._inflight[s.key] = t
            # Only forget our own entry: a newer attempt of the same sample may have replaced it.
            t.add_done_callback(lambda _t, k=s.key: self._inflight.get(k) is _t and self._inflight.pop(k))

    def _fs_has_room(self) -> bool:
        """The budget counts our files; the filesystem also holds files unlinked but still
        mapped by a trainer, and anyone else's. Never submit into a nearly full tmpfs.
        A "yes" is trusted for ``FS_CHECK_S`` (a statvfs per sample is a visible share of the
        sidecar's CPU: docs/benchmarks.md, sidecar throughput); a "no" is asked again each time."""
        if not self.spool_dir:
            return True
        now = time.monotonic()
        if now - self._fs_ok_at < FS_CHECK_S:
            return True
        try:
            ok = shutil.disk_usage(self.spool_dir).free > self.fs_reserve_bytes
        except OSError:
            ok = False
        self._fs_ok_at = now if ok else -1.0
        return ok

    def _sweep(self) -> str | None:
        """Samples whose request returned but whose notice never came are tried again; once
        every engine has been gone past the deadline, the reason to fail everything waiting."""
        self._forget_delivered()
        for s in self.ledger.stale_submissions(self.notice_timeout_s):
            if s.key not in self._inflight:
                self.stats["notice_timeouts"] += 1
                self.last_notice_timeout_at = time.monotonic()
                self.ledger.requeue(s.key, s.attempt, f"no notice from the connector within {self.notice_timeout_s:.0f} s")
        down = self.down_since
        if down is not None and time.monotonic() - down > self.down_deadline_s:
            return f"vLLM at {self.url} unreachable for more than {self.down_deadline_s:.0f} s"
        return None

    def fail_queued(self, reason: str) -> int:
        """Fail every queued sample with ``reason`` (a chunk per transaction: see the ledger)."""
        return self.ledger.fail_queued(lambda _s: reason)

    async def _submit(self, s: SampleRow, sem: asyncio.Semaphore, engine: Engine | None = None) -> None:
        e = engine or self.engines[0]
        if engine is None:
            e.in_flight += 1
        attempt = s.attempt
        t0 = time.monotonic()
        try:
            model = await self.engine_model(e)
            if reason := self._too_long(s):  # queued before the limit was known, or it changed
                self.stats["failed_over_engine_limit"] += 1
                self.ledger.fail(s.key, reason)
                return
            body = {
                "model": model,
                "prompt": s.token_ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": P.kv_params_for(P.RequestTag(key=s.key, attempt=attempt, slot=s.slot)),
            }
            job = self.ledger.jobs.get(s.key.job)
            sampling = job.sampling if job is not None else None
            if sampling is not None:
                # regenerate: vLLM writes a reply; states cover prompt + reply - 1 positions
                body.update({k: v for k, v in sampling.items() if v is not None}, return_token_ids=True)
                if sampling.get("seed") is not None:
                    body["seed"] = epoch_seed(int(sampling["seed"]), s.key.epoch)
                body["kv_transfer_params"]["include_output_tokens"] = True
            assert self._client is not None
            self.stats["requests"] += 1
            e.requests += 1
            r = await self._client.post_json(f"{e.url}/v1/completions", body)
            if r.status_code != 200:
                self.stats["http_errors"] += 1
                await ledger_call(self.ledger, self.ledger.requeue, s.key, attempt,
                                  f"vLLM answered {r.status_code}: {r.text[:300]}")  # fmt: skip
                return
            await ledger_call(self.ledger, self.ledger.responded, s.key, attempt)  # the notice timeout starts now
            if s.notice is None:  # its file is still to come from this engine's writer
                e.answered[s.key] = attempt
            if sampling is not None:
                out = (r.json().get("choices") or [{}])[0].get("token_ids")
                if not out:
                    self.ledger.requeue(s.key, attempt, "vLLM returned no token ids for the reply")
                    return
                made_ready = await ledger_call(self.ledger, self.ledger.set_generated, s.key, attempt, list(out))
                if made_ready and self.wake_delivery is not None:
                    self.wake_delivery()  # the delivery thread acts next: it offers the sample
            if self.on_latency:
                self.on_latency(time.monotonic() - t0)
        except (Unreachable, TimedOut, VllmUnavailable) as exc:
            # Not the sample's fault: wait for vLLM without spending an attempt.
            self.stats["vllm_down_retries"] += 1
            self.ledger.requeue(s.key, attempt, f"vLLM at {e.url} unreachable: {exc!r}", count_attempt=False)
            self._engine_down(e, exc)
        except HttpError as exc:  # an answer that is not HTTP: the request's own failure
            self.stats["http_errors"] += 1
            self.ledger.requeue(s.key, attempt, f"vLLM request failed: {exc!r}")
        except asyncio.CancelledError:
            self.ledger.requeue(s.key, attempt, "request cancelled", count_attempt=False)
            raise
        finally:
            e.in_flight -= 1
            sem.release()
