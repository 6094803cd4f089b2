"""Sends queued samples to vLLM, one prompt per ``/v1/completions`` call.

One prompt per call because vLLM returns ``kv_transfer_params`` only for the first prompt of
a multi-prompt request. Token ids, not text, and ``max_tokens=1``: we only want the prefill's
hidden states. The spool budget is enforced here, before a request exists: a sample is only
submitted once its expected bytes fit.
"""

from __future__ import annotations

import asyncio
import logging

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
        concurrency: int = 16,
        timeout_s: float = 600.0,
    ) -> None:
        self.ledger = ledger
        self.url = vllm_url.rstrip("/")
        self.budget = budget_bytes
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.model_name: str | None = None
        self.stats = {"requests": 0, "http_errors": 0}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout_s)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self._client:
            await self._client.aclose()

    def wake(self) -> None:
        self._wake.set()

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
        sem = asyncio.Semaphore(self.concurrency)
        inflight: set[asyncio.Task] = set()
        while True:
            await sem.acquire()
            s = self.ledger.next_to_submit(self.budget)
            if s is None:
                sem.release()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
                continue
            t = asyncio.create_task(self._submit(s, sem))
            inflight.add(t)
            t.add_done_callback(inflight.discard)

    async def _submit(self, s: Sample, sem: asyncio.Semaphore) -> None:
        attempt = s.attempt
        try:
            model = await self.vllm_model()
            body = {
                "model": model,
                "prompt": s.token_ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": P.kv_params_for(P.RequestTag(key=s.key, attempt=attempt)),
            }
            assert self._client is not None
            self.stats["requests"] += 1
            r = await self._client.post(f"{self.url}/v1/completions", json=body)
            if r.status_code != 200:
                self.stats["http_errors"] += 1
                self.ledger.submit_failed(s.key, attempt, f"vLLM answered {r.status_code}: {r.text[:300]}")
        except (httpx.HTTPError, VllmUnavailable) as e:
            self.stats["http_errors"] += 1
            self.model_name = None
            self.ledger.submit_failed(s.key, attempt, f"vLLM request failed: {e!r}")
            await asyncio.sleep(0.5)
        finally:
            sem.release()
