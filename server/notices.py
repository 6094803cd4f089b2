"""The sidecar's notice endpoint: connectors push, one thread here pulls.

A notice is input from another process: it is decoded strictly and its file name checked
against the spool before anything is touched. A notice naming a path outside the spool is
refused and logged; its "file" is left alone, since it is not ours.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import zmq

from connector import protocol as P
from server.ledger import Ledger

log = logging.getLogger("hsstream.sidecar")


def prepare_ipc(endpoint: str) -> None:
    """Create the directory of an ipc:// endpoint, private to this user (ipc has no auth)."""
    if endpoint.startswith("ipc://"):
        d = Path(endpoint[len("ipc://") :]).parent
        d.mkdir(parents=True, exist_ok=True, mode=0o700)


class NoticeReceiver:
    def __init__(self, endpoint: str, spool: Path, ledger: Ledger) -> None:
        self.endpoint = endpoint
        self.spool = spool
        self.ledger = ledger
        self.stats = {"notices": 0, "refused": 0, "deleted": 0, "foreign": 0}
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hsstream-notices", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._bound.wait(10)
        if self._error:
            raise self._error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            prepare_ipc(self.endpoint)
            sock = zmq.Context.instance().socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.endpoint)
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._bound.set()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(200):
                    self.handle(sock.recv())
        finally:
            sock.close()

    def handle(self, raw: bytes) -> None:
        self.stats["notices"] += 1
        try:
            n = P.Notice.decode(raw)
        except P.ProtocolError as e:
            self.stats["refused"] += 1
            log.error("refused notice: %s", e)
            return
        path = None
        if n.file is not None:
            try:
                path = P.resolve_in_spool(self.spool, n.file)
            except P.UnsafePathError as e:
                self.stats["refused"] += 1
                log.error("refused notice for %s: %s", n.request_id, e)
                n = n.model_copy(update={"status": P.NoticeStatus.error, "reason": str(e), "file": None})
            except FileNotFoundError:
                n = n.model_copy(update={"status": P.NoticeStatus.error, "reason": f"file {n.file} missing"})
        if n.key is None:
            # A request that did not come through us (drop-in use of the connector): not ours.
            self.stats["foreign"] += 1
            return
        size = path.stat().st_size if path is not None and n.status == P.NoticeStatus.ok else 0
        if self.ledger.on_notice(n, size) == "delete" and path is not None:
            self.stats["deleted"] += 1
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
