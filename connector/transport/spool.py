"""Same host: the trainer opens the spool file itself; no byte moves between processes."""

from __future__ import annotations

from pathlib import Path

from connector.contract import messages as M
from connector.transport import Receiver, Sender


class SpoolSender(Sender):
    name = "spool"
    sidecar_deletes = False  # the trainer deletes the file once it has checked it

    def offer(self, owner: bytes, key: M.SampleKey, path: Path | None) -> tuple[M.Descriptor | None, bytes | None]:
        return None, None


class SpoolReceiver(Receiver):
    name = "spool"
    reads_spool = True

    def fetch(self, d: M.Deliver, frame: bytes | None) -> bytes | memoryview | None:
        return None
