"""Sends queued samples to vLLM, one prompt per ``/v1/completions`` call.

One prompt per call because vLLM returns ``kv_transfer_params`` only for the first prompt of
a multi-prompt request. Token ids, not text, and ``max_tokens=1``: we only want the prefill's
hidden states. The spool budget is enforced here, before a request exists: a sample is only
submitted once its expected bytes fit.

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
from server.ledger import Ledger, Sample

log = logging.getLogger("hsstream.sidecar")


class VllmUnavailable(RuntimeError):
    pass


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
        self.down_since: float | None = None
        self.stats = {"requests": 0, "http_errors": 0, "vllm_down_retries": 0, "notice_timeouts": 0}
        self.latency: list[float] = []  # observed by /metrics
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._inflight: dict[P.SampleKey, asyncio.Task] = {}
        self.on_latency = None  # optional callback(seconds)

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout_s)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._inflight.values()) if t]
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

    async def vllm_model(self) -> str:
        """The served model name (asked once; vLLM rejects requests naming another)."""
        if self.model_name is None:
            assert self._client is not None
            try:
                r = await self._client.get(f"{self.url}/v1/models", timeout=5)
                r.raise_for_status()
                self.model_name = r.json()["data"][0]["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                raise VllmUnavailable(f"vLLM at {self.url} is not reachable: {e!r}") from e
        return self.model_name

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
            s = self.ledger.next_to_submit(self.budget, self.max_ready) if self._fs_has_room() else None
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
            body = {
                "model": model,
                "prompt": s.token_ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": P.kv_params_for(P.RequestTag(key=s.key, attempt=attempt)),
            }
            sampling = self.ledger.jobs[s.key.job].sampling
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
