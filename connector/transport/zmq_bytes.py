"""The file's bytes as the DELIVER's payload frame, over the trainer's own ZeroMQ connection
(CURVE over TCP for another host). Simple, but the sidecar's delivery thread reads and sends
every byte: one thread on one host carries the whole stream."""

from __future__ import annotations

from pathlib import Path

from connector.contract import messages as M
from connector.transport import Receiver, Sender


class ZmqSender(Sender):
    name = "zmq"

    def offer(self, owner: bytes, key: M.SampleKey, path: Path | None) -> tuple[M.Descriptor | None, bytes | None]:
        assert path is not None
        return None, path.read_bytes()


class ZmqReceiver(Receiver):
    name = "zmq"

    def fetch(self, d: M.Deliver, frame: bytes | None) -> bytes | memoryview | None:
        if frame is None:
            raise M.ProtocolError("remote delivery without the file's bytes")
        return frame
