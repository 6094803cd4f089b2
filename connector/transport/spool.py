"""Same host: the trainer opens the spool file itself; no byte moves between processes."""

from __future__ import annotations

from pathlib import Path

from connector import protocol as P
from connector.transport import Receiver, Sender


class SpoolSender(Sender):
    name = "spool"
    sidecar_deletes = False  # the trainer deletes the file once it has checked it

    def offer(self, owner: bytes, key: P.SampleKey, path: Path | None) -> tuple[P.Transfer | None, bytes | None]:
        return None, None


class SpoolReceiver(Receiver):
    name = "spool"
    reads_spool = True

    def fetch(self, d: P.Deliver, frame: bytes | None) -> bytes | memoryview | None:
        return None
