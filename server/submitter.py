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
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time

import httpx

from connector import protocol as P
from server.ledger import Ledger, Sample, State
from server.model_shape import SampleSizer, over_budget_reason, too_long_reason

log = logging.getLogger("hsstream.sidecar")


class VllmUnavailable(RuntimeError):
    pass


#: Connections per httpx client in :class:`ShardedClient`.
CONNECTIONS_PER_SHARD = 4


class ShardedClient:
    """Several httpx clients used in turn, each holding a few of the in-flight requests' connections.

    httpcore 1.0's pool walks every pooled connection, with a readability syscall for each idle
    one, whenever a request starts or ends: with 16 requests in flight one ``post`` cost 1.4 ms of
    CPU, half of the sidecar's time per sample (bench/sidecar_throughput.py). Pools of at most
    ``CONNECTIONS_PER_SHARD`` connections keep that walk short (0.6 ms per request measured).
    Same calls as the one client it replaces: ``get``, ``post``, ``aclose``.
    """

    def __init__(self, concurrency: int, **kw: object) -> None:
        n = max(1, -(-concurrency // CONNECTIONS_PER_SHARD))
        self._clients = [httpx.AsyncClient(**kw) for _ in range(n)]  # type: ignore[arg-type]
        self._next = 0

    def _pick(self) -> httpx.AsyncClient:
        self._next = (self._next + 1) % len(self._clients)
        return self._clients[self._next]

    async def get(self, url: str, **kw: object) -> httpx.Response:
        return await self._pick().get(url, **kw)  # type: ignore[arg-type]

    async def post(self, url: str, **kw: object) -> httpx.Response:
        return await self._pick().post(url, **kw)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        for c in self._clients:
            await c.aclose()


class Submitter:
    def __init__(
        self,
        ledger: Ledger,
        vllm_url: str,
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
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.ledger = ledger
        self.url = vllm_url.rstrip("/")
        self.budget = budget_bytes
        self.max_ready = max_ready
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.down_deadline_s = down_deadline_s
        self.notice_timeout_s = notice_timeout_s
        self.spool_dir = spool_dir
        self.fs_reserve_bytes = fs_reserve_bytes
        self.model_name: str | None = None
        self.engine_max_len: int | None = None  # vLLM's max_model_len, once it answered
        self.on_engine_limit = None  # optional callback(max_model_len), for admission
        self.sizer = sizer
        self._transport = transport
        self._applied: tuple[int, int | None] = (-1, None)  # (sizer version, engine limit) applied to the queue
        self.in_flight = 0  # SUBMITTED samples, kept by a ledger listener
        ledger.listeners.append(self._on_transition)
        self.down_since: float | None = None
        self.stats = {"requests": 0, "http_errors": 0, "vllm_down_retries": 0, "notice_timeouts": 0,
                      "submitted_before_size_known": 0, "max_in_flight_before_size_known": 0,
                      "failed_over_engine_limit": 0}  # fmt: skip
        self.latency: list[float] = []  # observed by /metrics
        self._client: ShardedClient | httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._inflight: dict[P.SampleKey, asyncio.Task] = {}
        self.on_latency = None  # optional callback(seconds)

    async def start(self) -> None:
        self._client = ShardedClient(self.concurrency, timeout=self.timeout_s, transport=self._transport)
        self._task = asyncio.create_task(self._loop())
        self._probe = asyncio.create_task(self._probe_engine_until_known())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._probe, *self._inflight.values()) if t]
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

    async def vllm_model(self, timeout: float = 5.0) -> str:
        """The served model name (asked once; vLLM rejects requests naming another)."""
        if self.model_name is None:
            assert self._client is not None
            try:
                r = await self._client.get(f"{self.url}/v1/models", timeout=timeout)
                r.raise_for_status()
                card = r.json()["data"][0]
                self.model_name = card["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
                raise VllmUnavailable(f"vLLM at {self.url} is not reachable: {e!r}") from e
            self._set_engine_limit(card.get("max_model_len"))
        return self.model_name

    def _set_engine_limit(self, n: object) -> None:
        if not isinstance(n, int) or n <= 0 or n == self.engine_max_len:
            return
        log.info("vLLM serves at most %d tokens per sequence (max_model_len): longer samples are refused", n)
        self.engine_max_len = n
        if self.on_engine_limit:
            self.on_engine_limit(n)
        self._apply_limits()

    async def probe_engine(self, timeout: float = 2.0) -> int | None:
        """vLLM's max_model_len, asking vLLM if it is not known yet; None while vLLM is away."""
        if self.engine_max_len is None and self._client is not None:
            try:
                self.model_name = None
                await self.vllm_model(timeout)
            except VllmUnavailable:
                pass
        return self.engine_max_len

    async def _probe_engine_until_known(self) -> None:
        """Learn the engine's limit as soon as vLLM answers, not only once a job needs it."""
        while self.engine_max_len is None:
            await self.probe_engine()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ limits
    def _on_transition(self, new: State, old: State | None, n: int, _tokens: int) -> None:
        self.in_flight += n * ((new == State.submitted) - (old == State.submitted))

    def _room(self, s: Sample) -> int:
        """Tokens vLLM generates beyond the prompt: 1, or the regenerated reply."""
        sampling = self.ledger.jobs[s.key.job].sampling
        return int(sampling.get("max_tokens") or 1) if sampling is not None else 1

    def _too_long(self, s: Sample) -> str | None:
        if self.engine_max_len is None or (s.generated and self.ledger.jobs[s.key.job].sampling is not None):
            return None
        if len(s.token_ids) + self._room(s) <= self.engine_max_len:
            return None
        return too_long_reason(len(s.token_ids), self.engine_max_len, self._room(s), "vLLM's max_model_len")

    def _apply_limits(self) -> None:
        """Apply a newly known sample size or engine limit to the samples already queued."""
        version = self.sizer.version if self.sizer else 0
        if (version, self.engine_max_len) == self._applied:
            return
        if self.sizer is not None and self.sizer.known and version != self._applied[0]:
            sizer = self.sizer

            def size_of(s: Sample) -> int:
                pos = len(s.token_ids) + (self._room(s) if self.ledger.jobs[s.key.job].sampling is not None else 0)
                return sizer.file_bytes(pos) or 0

            n = self.ledger.reprice_queued(size_of)
            log.info("sample size %s: %d queued sample(s) priced again", sizer.describe(), n)
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
        while True:
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
        while True:
            if time.monotonic() - last_sweep > 1.0:
                last_sweep = time.monotonic()
                self._sweep()
            if self.down_since is not None:
                # Probe instead of burning requests while vLLM is away.
                try:
                    self.model_name = None
                    await self.vllm_model()
                    log.info("vLLM is back after %.0f s", time.monotonic() - self.down_since)
                    self.down_since = None
                except VllmUnavailable:
                    await asyncio.sleep(1.0)
                    continue
            await sem.acquire()
            self._apply_limits()
            sized = self._sized()
            # size unknown: one sample at a time, its notice will tell the size
            ok = self._fs_has_room() and (sized or self.in_flight == 0)
            s = self.ledger.next_to_submit(self.budget, self.max_ready) if ok else None
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
            t = asyncio.create_task(self._submit(s, sem))
            self._inflight[s.key] = t
            # Only forget our own entry: a newer attempt of the same sample may have replaced it.
            t.add_done_callback(lambda _t, k=s.key: self._inflight.get(k) is _t and self._inflight.pop(k))

    def _fs_has_room(self) -> bool:
        """The budget counts our files; the filesystem also holds files unlinked but still
        mapped by a trainer, and anyone else's. Never submit into a nearly full tmpfs."""
        if not self.spool_dir:
            return True
        try:
            return shutil.disk_usage(self.spool_dir).free > self.fs_reserve_bytes
        except OSError:
            return False

    def _sweep(self) -> None:
        """Samples whose request returned but whose notice never came are tried again, and
        everything waiting is failed once vLLM has been gone past the deadline."""
        for s in self.ledger.stale_submissions(self.notice_timeout_s):
            if s.key not in self._inflight:
                self.stats["notice_timeouts"] += 1
                self.ledger.requeue(s.key, s.attempt, f"no notice from the connector within {self.notice_timeout_s:.0f} s")
        if self.down_since is not None and time.monotonic() - self.down_since > self.down_deadline_s:
            reason = f"vLLM at {self.url} unreachable for more than {self.down_deadline_s:.0f} s"
            while (s := self.ledger.next_to_submit(2**62)) is not None:
                self.ledger.fail(s.key, reason)

    async def _submit(self, s: Sample, sem: asyncio.Semaphore) -> None:
        attempt = s.attempt
        t0 = time.monotonic()
        try:
            model = await self.vllm_model()
            if reason := self._too_long(s):  # queued before the limit was known, or it changed
                self.stats["failed_over_engine_limit"] += 1
                self.ledger.fail(s.key, reason)
                return
            body = {
                "model": model,
                "prompt": s.token_ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": P.kv_params_for(P.RequestTag(key=s.key, attempt=attempt)),
            }
            job = self.ledger.jobs.get(s.key.job)
            sampling = job.sampling if job is not None else None
            if sampling is not None:
                # regenerate: vLLM writes a reply; states cover prompt + reply - 1 positions
                body.update({k: v for k, v in sampling.items() if v is not None}, return_token_ids=True)
                body["kv_transfer_params"]["include_output_tokens"] = True
            assert self._client is not None
            self.stats["requests"] += 1
            r = await self._client.post(f"{self.url}/v1/completions", json=body)
            if r.status_code != 200:
                self.stats["http_errors"] += 1
                self.ledger.requeue(s.key, attempt, f"vLLM answered {r.status_code}: {r.text[:300]}")
                return
            self.ledger.responded(s.key, attempt)  # the notice timeout starts now
            if sampling is not None:
                out = (r.json().get("choices") or [{}])[0].get("token_ids")
                if not out:
                    self.ledger.requeue(s.key, attempt, "vLLM returned no token ids for the reply")
                    return
                self.ledger.set_generated(s.key, attempt, list(out))
            if self.on_latency:
                self.on_latency(time.monotonic() - t0)
        except (httpx.TransportError, VllmUnavailable) as e:
            # Not the sample's fault: wait for vLLM without spending an attempt.
            self.stats["vllm_down_retries"] += 1
            self.model_name = None
            if self.down_since is None:
                self.down_since = time.monotonic()
                log.warning("vLLM unreachable (%r): holding submissions until it is back", e)
            self.ledger.requeue(s.key, attempt, f"vLLM unreachable: {e!r}", count_attempt=False)
        except httpx.HTTPError as e:
            self.stats["http_errors"] += 1
            self.ledger.requeue(s.key, attempt, f"vLLM request failed: {e!r}")
        except asyncio.CancelledError:
            self.ledger.requeue(s.key, attempt, "request cancelled", count_attempt=False)
            raise
        finally:
            sem.release()
