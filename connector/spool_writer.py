"""Writer threads and the notice socket: everything the connector does after the copy.

Runs inside vLLM's worker process (TP rank 0) but never on the engine's step: the step only
enqueues. Files are written under a hidden temporary name and renamed into place, so a
reader never sees a half-written file; the notice is sent only after the rename. One thread
owns the PUSH socket (ZeroMQ sockets are not thread-safe); writers hand it notices through a
queue. The connector connects, the sidecar binds: engines can come and go freely.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq
from safetensors.torch import save_file

from connector import protocol as P

log = logging.getLogger("hsstream.connector")


@dataclass
class WriteJob:
    request_id: str
    file: str
    tag: P.RequestTag | None
    token_ids: list[int]
    hidden_states: torch.Tensor  # host tensor [T, K, H]; may still be filling (see ready)
    ready: Callable[[], None] | None = None  # blocks until the async copy has landed


@dataclass(frozen=True)
class ShapeInfo:
    """What every notice repeats about the verifier, so a trainer can check before loading."""

    layer_ids: list[int]
    num_hidden_layers: int
    hidden_size: int
    dtype: str
    model: str


class SpoolWriter:
    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        notice_endpoint: str | None,
        shape: ShapeInfo,
        num_threads: int = 4,
        checksum_algo: str = P.CHECKSUM_ALGO,
    ) -> None:
        self.spool = Path(spool_dir)
        self.checksum_algo = checksum_algo
        self.shape = shape
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="hsstream-write")
        self._notices: queue.Queue[bytes | None] = queue.Queue()
        self._endpoint = notice_endpoint
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        if notice_endpoint:
            self._sender = threading.Thread(target=self._send_loop, name="hsstream-notice", daemon=True)
            self._sender.start()

    # -- called from the engine's step: must return at once ---------------------------------
    def submit(self, job: WriteJob) -> None:
        with self._lock:
            self._pending += 1
        self._pool.submit(self._write, job)

    def submit_error(self, request_id: str, tag: P.RequestTag | None, reason: str) -> None:
        self._publish(self._notice(request_id, tag, status=P.NoticeStatus.error, reason=reason))

    # -- writer threads ----------------------------------------------------------------------
    def _notice(self, request_id: str, tag: P.RequestTag | None, **kw: object) -> P.Notice:
        s = self.shape
        return P.Notice(
            request_id=request_id,
            key=tag.key if tag else None,
            attempt=tag.attempt if tag else 0,
            layer_ids=s.layer_ids,
            num_hidden_layers=s.num_hidden_layers,
            hidden_size=s.hidden_size,
            dtype=s.dtype,
            model=s.model,
            **kw,  # type: ignore[arg-type]
        )

    def _write(self, job: WriteJob) -> None:
        tmp = self.spool / P.tmp_name_for(job.file)
        try:
            if job.ready is not None:
                job.ready()
            hs = job.hidden_states
            ids = torch.tensor(job.token_ids, dtype=torch.int64)
            if hs.shape[0] != ids.shape[0]:
                raise ValueError(f"{hs.shape[0]} hidden-state rows for {ids.shape[0]} tokens")
            digest = P.checksum(hs.view(torch.uint8).numpy(), ids.numpy(), algo=self.checksum_algo)
            notice = self._notice(
                job.request_id,
                job.tag,
                status=P.NoticeStatus.ok,
                file=job.file,
                num_tokens=int(ids.shape[0]),
                nbytes=hs.numel() * hs.element_size(),
                checksum=digest,
                checksum_algo=self.checksum_algo,
            )
            save_file(
                {P.HIDDEN_STATES_KEY: hs, P.TOKEN_IDS_KEY: ids},
                str(tmp),
                metadata=P.header_metadata(notice),
            )
            os.rename(tmp, self.spool / job.file)
        except BaseException as e:  # noqa: BLE001 - every failure must become a notice
            log.exception("hidden-state write failed for %s", job.request_id)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            notice = self._notice(job.request_id, job.tag, status=P.NoticeStatus.error, reason=f"write failed: {e!r}")
        finally:
            job.hidden_states = None  # type: ignore[assignment]  # release pinned memory now
        self._publish(notice)
        with self._lock:
            self._pending -= 1
            self._idle.notify_all()

    def _publish(self, notice: P.Notice) -> None:
        if self._sender is not None:
            self._notices.put(notice.encode())

    # -- the socket's owner thread -----------------------------------------------------------
    def _send_loop(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(self._endpoint)
        try:
            while True:
                msg = self._notices.get()
                if msg is None:
                    break
                sock.send(msg)
        finally:
            sock.close()

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._sender is not None:
            self._notices.put(None)
            self._sender.join(timeout=10)
