"""How a delivered sample's bytes reach a trainer: one interface, three ways.

The control plane (notices, credit, leases, RECEIVED/ACK/FAIL, the ledger) does not care which
way the bytes go; only this package does. Each way has two halves:

* a :class:`Sender` in the sidecar's delivery thread, which *offers* a leased sample's file
  (``offer``: a descriptor for the DELIVER and/or a payload frame) and lets go of it when the
  trainer holds the bytes, reported it invalid, or was lost (``release``);
* a :class:`Receiver` in the trainer's stream, which turns a DELIVER into the file's bytes
  (``fetch``) before the stream checks them.

=========  =====================================  ========================================
name       bytes travel                           who deletes the spool file
=========  =====================================  ========================================
spool      not at all: the trainer reads /dev/shm  the trainer (same host only)
zmq        in the DELIVER's third frame (CURVE)    the sidecar, on RECEIVED
mooncake   Mooncake Transfer Engine read from the  the sidecar, on RECEIVED
           sidecar host's registered mmap of the
           file into the trainer's buffer
=========  =====================================  ========================================

A trainer picks one (``HiddenStateStream(transport=…)`` or ``HSSTREAM_TRANSPORT``) and says so
in its HELLO; the sidecar serves each trainer its own way, or refuses one it does not offer.
The Mooncake halves import ``mooncake`` only when built, so the base install does not need it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from connector import protocol as P


class TransportError(RuntimeError):
    """The bytes could not be moved (not the sample's fault: nothing is reported failed)."""


class Sender(ABC):
    """The sidecar's half. Called from the delivery thread only."""

    name: str
    #: The sidecar deletes the file on RECEIVED (the trainer cannot: it is on another host).
    sidecar_deletes: bool = True

    @abstractmethod
    def offer(self, owner: bytes, key: P.SampleKey, path: Path | None) -> tuple[P.Transfer | None, bytes | None]:
        """(descriptor for the DELIVER, payload frame) for a leased sample's file (``path``:
        checked to be in the spool; None for a sender that does not open files); raises OSError
        when the file is gone (the sample is produced again)."""

    def release(self, key: P.SampleKey) -> None:
        """The trainer holds the bytes, or will never fetch them: free what ``offer`` took."""

    def release_owner(self, owner: bytes) -> None:
        """A trainer is gone: free everything offered to it."""

    def close(self) -> None:
        pass


class Receiver(ABC):
    """The trainer's half. Called from the stream's iterating thread only."""

    name: str
    #: Reads the file in the spool itself (and deletes it once checked).
    reads_spool: bool = False

    @abstractmethod
    def fetch(self, d: P.Deliver, frame: bytes | None) -> bytes | memoryview | None:
        """The file's bytes (None: read it from the spool); raises :class:`TransportError`.
        A returned memoryview is valid until the next ``fetch``."""

    def close(self) -> None:
        pass


def make_sender(name: str, **kw: object) -> Sender:
    if name == "spool":
        from connector.transport.spool import SpoolSender

        return SpoolSender()
    if name == "zmq":
        from connector.transport.zmq_bytes import ZmqSender

        return ZmqSender()
    if name == "mooncake":
        from connector.transport.mooncake import MooncakeSender

        return MooncakeSender(**kw)  # type: ignore[arg-type]
    raise ValueError(f"unknown transport {name!r} (one of {', '.join(P.TRANSPORTS)})")


def make_receiver(name: str, **kw: object) -> Receiver:
    if name == "spool":
        from connector.transport.spool import SpoolReceiver

        return SpoolReceiver()
    if name == "zmq":
        from connector.transport.zmq_bytes import ZmqReceiver

        return ZmqReceiver()
    if name == "mooncake":
        from connector.transport.mooncake import MooncakeReceiver

        return MooncakeReceiver(**kw)  # type: ignore[arg-type]
    raise ValueError(f"unknown transport {name!r} (one of {', '.join(P.TRANSPORTS)})")


__all__ = ["Receiver", "Sender", "TransportError", "make_receiver", "make_sender"]
