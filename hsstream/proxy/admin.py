"""The proxy's admin routes (its admin token): the live draft, swaps, rollback, the held-out
slice and the deletion of what was teed.

``POST /admin/swap {"draft", "version"}`` swaps the draft vLLM serves without a restart of
anything the clients see, one of two ways:

* **in place** (``"mode": "in_place"``): the live engine loads the new draft's weights through
  vLLM's weight-transfer API (``/start_draft_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) with our file backend (``hsstream/weight_swap.py``); requests keep
  running on the same engine, between two of its steps the draft changes;
* **blue/green** (the default in managed mode): a second engine with the new draft is started
  (``engines.py``), and once it answers every new request goes to it while the old one
  finishes what it has; when it holds nothing it is stopped.

``POST /admin/upstream {"url", "version"}`` is blue/green with an engine the operator started.
Swaps run one at a time; each is logged in ``state_dir/swaps.jsonl`` with its version, the
gate's figures the caller measured (``"gate"``), and how long it took. ``POST /admin/rollback``
swaps back to the previous version the same way.

No swap fails a client request: the switch only changes which engine new requests take, and
an engine is stopped only when it holds none (``upstreams.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any
from urllib.parse import parse_qs

import aiohttp

from hsstream.proxy.app import error_body, read_body, send_json
from hsstream.proxy.metrics import ProxyMetrics
from hsstream.proxy.settings import ProxySettings
from hsstream.proxy.store import TeedStore
from hsstream.proxy.upstreams import Upstream, Upstreams

log = logging.getLogger("hsstream.proxy")

#: Longest an old engine is given to finish its requests before it is stopped anyway.
DRAIN_TIMEOUT_S = 900.0


class SwapError(RuntimeError):
    pass


class Admin:
    def __init__(self, s: ProxySettings, ups: Upstreams, m: ProxyMetrics, store: TeedStore, tee: Any,  # noqa: ANN401
                 engines: Any = None) -> None:  # noqa: ANN401  # fmt: skip
        self.s, self.ups, self.m, self.store, self.tee, self.engines = s, ups, m, store, tee, engines
        self._lock = asyncio.Lock()
        self._app: Any = None
        self._bg: set[asyncio.Task] = set()
        self.swap_log = s.state_dir / "swaps.jsonl"
        self.swapping: dict | None = None

    async def startup(self, app: Any) -> None:  # noqa: ANN401
        self._app = app

    async def shutdown(self) -> None:
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.engines is not None:  # managed engines go with the proxy
            for u in [self.ups.live, *self.ups.draining]:
                if u.handle is not None:
                    await asyncio.to_thread(self.engines.stop, u.handle)
                    u.handle = None

    # ------------------------------------------------------------------ routing
    async def handle(self, scope: dict, receive: Any, send: Any) -> None:  # noqa: ANN401
        path, method = scope["path"], scope["method"]
        query = {k: v[-1] for k, v in parse_qs((scope.get("query_string") or b"").decode()).items()}
        body: dict = {}
        if method == "POST":
            raw = await read_body(receive, 64 * 1024)
            try:
                body = json.loads(raw or b"{}") if raw is not None else None  # type: ignore[assignment]
            except ValueError:
                body = None  # type: ignore[assignment]
            if not isinstance(body, dict):
                await send_json(send, 400, error_body(400, "the body must be a JSON object (at most 64 KiB)", "BadRequest"))
                return
        try:
            if (method, path) == ("GET", "/admin/state"):
                out = self.state()
            elif (method, path) == ("GET", "/admin/heldout"):
                out = {"samples": await asyncio.to_thread(self.store.heldout, _int(query.get("limit"), None))}
            elif (method, path) == ("POST", "/admin/swap"):
                out = await self.swap(_str(body, "draft"), _str(body, "version"), mode=body.get("mode"),
                                      gate=body.get("gate"))  # fmt: skip
            elif (method, path) == ("POST", "/admin/upstream"):
                out = await self.switch_to(_str(body, "url").rstrip("/"), _str(body, "version"), draft=body.get("draft"),
                                           gate=body.get("gate"))  # fmt: skip
            elif (method, path) == ("POST", "/admin/refused"):  # a gate said no: logged, counted
                out = {"t": time.time(), "from": self.ups.live.version, "to": _str(body, "version"),
                       "gate": body.get("gate"), "result": "refused_by_gate"}  # fmt: skip
                self.m.swaps.labels("refused").inc()
                self._log(out)
            elif (method, path) == ("POST", "/admin/rollback"):
                out = await self.rollback()
            elif (method, path) == ("POST", "/admin/forget"):
                out = await self.forget(body.get("before"))
            else:
                await send_json(send, 404, error_body(404, f"no admin route {method} {path}", "NotFoundError"))
                return
        except (SwapError, ValueError) as e:
            await send_json(send, 409 if isinstance(e, SwapError) else 400,
                            error_body(409 if isinstance(e, SwapError) else 400, str(e), type(e).__name__))  # fmt: skip
            return
        await send_json(send, 200, out)

    def state(self) -> dict:
        tee = None
        if self.tee is not None:
            tee = {o: int(self.m.tee.labels(o)._value.get()) for o in _outcomes()}
        return {**self.ups.state(), "swapping": self.swapping, "tee": tee, "stored": self.store.counts()}

    # ------------------------------------------------------------------ swaps
    async def swap(self, draft: str, version: str, *, mode: str | None = None, gate: dict | None = None) -> dict:
        if mode not in (None, "blue_green", "in_place"):
            raise ValueError(f"mode {mode!r}: blue_green or in_place")
        draft = await asyncio.to_thread(self._keep_copy, draft, version)
        if mode == "in_place" or (mode is None and self.engines is not None and self.engines.weight_transfer):
            return await self._locked(version, gate, self._in_place, draft, version)
        if self.engines is None:
            raise SwapError("this proxy does not start engines (no --model): start the new one yourself and "
                            "POST /admin/upstream {url, version}, or swap in place")  # fmt: skip
        return await self._locked(version, gate, self._blue_green, draft, version)

    async def switch_to(self, url: str, version: str, *, draft: str | None = None, gate: dict | None = None) -> dict:
        return await self._locked(version, gate, self._external, url, version, draft)

    async def rollback(self) -> dict:
        prev = self.ups.previous()
        if prev is None:
            raise SwapError("no earlier version to roll back to")
        version = prev["version"]
        if self.engines is not None and (prev["draft"] or self.engines.weight_transfer is None):
            return await self.swap(prev["draft"], version, gate={"rollback": True})
        if await _answers(self._session(), prev["url"]):
            return await self.switch_to(prev["url"], version, draft=prev["draft"], gate={"rollback": True})
        raise SwapError(f"version {version}'s engine at {prev['url']} does not answer: start it again and "
                        "POST /admin/upstream")  # fmt: skip

    async def _locked(self, version: str, gate: dict | None, fn: Any, *args: Any) -> dict:  # noqa: ANN401
        if self._lock.locked():
            raise SwapError(f"a swap is under way ({self.swapping}); try again when it ended")
        async with self._lock:
            t0 = time.monotonic()
            before = self.ups.live.version
            self.swapping = {"to": version, "since": time.time()}
            rec = {"t": time.time(), "from": before, "to": version, "gate": gate}
            try:
                rec.update(await fn(*args))
                rec["result"] = "done"
                self.m.swaps.labels("done").inc()
                return rec
            except BaseException as e:
                rec.update(result="failed", error=str(e)[:2000])
                self.m.swaps.labels("failed").inc()
                if isinstance(e, (SwapError, ValueError)):
                    raise
                raise SwapError(f"swap to {version} failed: {e}") from e
            finally:
                rec["seconds"] = round(time.monotonic() - t0, 3)
                self.m.swap_seconds.set(rec["seconds"])
                self.swapping = None
                self._log(rec)

    #: Drafts kept in STATE_DIR/drafts (the live one, and those a rollback may go back to).
    KEEP_DRAFTS = 4

    def _keep_copy(self, draft: str, version: str) -> str:
        """The draft copied into the proxy's state dir (a training run rotates its checkpoints
        away; a rollback must still find the draft it goes back to); the copy's path."""
        import shutil
        from pathlib import Path

        from hsstream.weight_swap import draft_files

        src = Path(draft).resolve()
        root = (self.s.state_dir / "drafts").resolve()
        if src.parent == root:
            return str(src)  # one of ours already (a rollback)
        draft_files(src)  # checked before anything is copied
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in version)[:80] or "v"
        dst = root / safe
        tmp = root / f".{safe}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
        live = {str(Path(u.draft).resolve()) for u in [self.ups.live, *self.ups.draining] if u.draft}
        kept = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                      key=lambda p: p.stat().st_mtime, reverse=True)  # fmt: skip
        for old in kept[self.KEEP_DRAFTS:]:
            if str(old) not in live and old != dst:
                shutil.rmtree(old, ignore_errors=True)
        return str(dst)

    def _log(self, rec: dict) -> None:
        self.s.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.swap_log, "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def _session(self) -> aiohttp.ClientSession:
        return self._app.session

    async def _drain_then(self, old: Upstream) -> dict:
        t0 = time.monotonic()
        ok = await self.ups.wait_drained(old, DRAIN_TIMEOUT_S)
        out = {"drained": ok, "drain_seconds": round(time.monotonic() - t0, 3)}
        if old.handle is not None and self.engines is not None:
            code = await asyncio.to_thread(self.engines.stop, old.handle)
            old.handle = None
            out["old_engine_exit"] = code
        return out

    async def _blue_green(self, draft: str, version: str) -> dict:
        t0 = time.monotonic()
        url, child = await asyncio.to_thread(self.engines.start, draft, version)
        started = round(time.monotonic() - t0, 3)
        new = Upstream(url, version, draft, handle=child)
        if not await _answers(self._session(), url):
            await asyncio.to_thread(self.engines.stop, child)
            raise SwapError(f"the new engine at {url} started but does not answer /v1/models")
        old = self.ups.switch(new)
        return {"mode": "blue_green", "url": url, "engine_start_seconds": started, **await self._drain_then(old)}

    async def _external(self, url: str, version: str, draft: str | None) -> dict:
        if not await _answers(self._session(), url):
            raise SwapError(f"{url} does not answer /v1/models: not switching to it")
        old = self.ups.switch(Upstream(url, version, draft))
        return {"mode": "blue_green", "url": url, **await self._drain_then(old)}

    async def _in_place(self, draft: str, version: str) -> dict:
        from hsstream import weight_swap

        live = self.ups.live
        t0 = time.monotonic()
        # digest: the engine logs its draft's parameter digest before and after (an audit of the load)
        await weight_swap.push_draft(self._session(), live.url, draft, version, digest=True)
        # Same engine, new weights: the version changes for the requests from now on.
        new = Upstream(live.url, version, draft, handle=live.handle)
        new.in_flight = 0
        live.handle = None
        old = self.ups.switch(new)
        await self.ups.wait_drained(old, DRAIN_TIMEOUT_S)
        return {"mode": "in_place", "url": live.url, "update_seconds": round(time.monotonic() - t0, 3)}

    # ------------------------------------------------------------------ deletion
    async def forget(self, before: float | None) -> dict:
        """Delete what was teed before ``before`` (a time.time(); None: all): the proxy's store and
        the sidecar's traffic jobs (cancelled and purged)."""
        if before is not None and not isinstance(before, (int, float)):
            raise ValueError("before: a UNIX time in seconds, or null for everything")
        out = await asyncio.to_thread(self.store.forget, before)
        purged, failed = [], []
        if out["jobs"]:
            from connector.contract.rest_client import SidecarClient, SidecarError

            from hsstream.proxy.tee import purge_job

            def purge_all() -> None:
                with SidecarClient(self.s.sidecar(), token=None, timeout=60) as c:
                    for j in out["jobs"]:
                        try:
                            purge_job(c, j["job_id"])
                            purged.append(j["job_id"])
                        except SidecarError as e:
                            (purged if e.status == 404 else failed).append(j["job_id"])

            await asyncio.to_thread(purge_all)
        if failed:  # kept listed, so that a later forget tries them again
            for j in out["jobs"]:
                if j["job_id"] in failed:
                    self.store.add_job(j["job_id"], j["n"], j["options_key"], now=j["t"])
        return {"deleted": out["deleted"], "purged_jobs": purged, "failed_jobs": failed}


async def _answers(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return r.status in (200, 401)  # 401: it answers, and wants vLLM's key
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def _outcomes() -> tuple[str, ...]:
    from hsstream.proxy.metrics import TEE_OUTCOMES

    return TEE_OUTCOMES


def _str(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{key}: a non-empty string is needed")
    return v


def _int(v: str | None, default: int | None) -> int | None:
    if v is None:
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"not an integer: {v!r}") from None
    if n < 1:
        raise ValueError(f"must be at least 1: {n}")
    return n
