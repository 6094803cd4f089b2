"""How a delivered sample's bytes reach a trainer: one interface, a registry of the ways.

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
A transport is one module with its two halves plus one line in :data:`REGISTRY` (name →
module, sender and receiver classes); each half builds itself from the settings
(``from_settings``), and a descriptor the DELIVER carries for it (``Deliver.transfer``) is its
own model, checked by its receiver (Mooncake's ``Transfer``). The sidecar offers every way its
settings configure (:func:`senders_from_settings`); the stream builds the receiver of the one
it asks for (:func:`receiver_from_settings`). A module is imported only when a half is built,
so the base install does not need ``mooncake``.
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from connector.contract import messages as M

if TYPE_CHECKING:
    from connector.contract.settings import Settings

_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")  # as messages.TransportName


class TransportError(RuntimeError):
    """The bytes could not be moved (not the sample's fault: nothing is reported failed)."""


class Sender(ABC):
    """The sidecar's half. Called from the delivery thread only."""

    name: str
    #: The sidecar deletes the file on RECEIVED (the trainer cannot: it is on another host).
    sidecar_deletes: bool = True

    @abstractmethod
    def offer(self, owner: bytes, key: M.SampleKey, path: Path | None) -> tuple[M.Descriptor | None, bytes | None]:
        """(descriptor for the DELIVER, payload frame) for a leased sample's file (``path``:
        checked to be in the spool; None for a sender that does not open files); raises OSError
        when the file is gone (the sample is produced again)."""

    @classmethod
    def from_settings(cls, s: Settings) -> Sender | None:
        """This sender as the sidecar's settings configure it; None: not offered by them."""
        return cls()

    def release(self, key: M.SampleKey) -> None:
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
    def fetch(self, d: M.Deliver, frame: bytes | None) -> bytes | memoryview | None:
        """The file's bytes (None: read it from the spool); raises :class:`TransportError`.
        A returned memoryview is valid until the next ``fetch``."""

    @classmethod
    def from_settings(cls, s: Settings, endpoint: str) -> Receiver:
        """This receiver as a trainer's settings configure it, for the sidecar at ``endpoint``."""
        return cls()

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Way:
    """One transport in the registry: the module holding its halves (imported only when one is
    built, so a heavy dependency such as Mooncake's stays out of the base install) and the
    names of its :class:`Sender` and :class:`Receiver` classes there."""

    module: str
    sender: str
    receiver: str
    #: Only for a trainer on the sidecar's host (it reads the spool itself).
    same_host_only: bool = False

    def sender_class(self) -> type[Sender]:
        return getattr(importlib.import_module(self.module), self.sender)

    def receiver_class(self) -> type[Receiver]:
        return getattr(importlib.import_module(self.module), self.receiver)


#: Every transport, by the name a HELLO carries. Adding one is its module plus one line here.
REGISTRY: dict[str, Way] = {
    "spool": Way("connector.transport.spool", "SpoolSender", "SpoolReceiver", same_host_only=True),
    "zmq": Way("connector.transport.zmq_bytes", "ZmqSender", "ZmqReceiver"),
    "mooncake": Way("connector.transport.mooncake", "MooncakeSender", "MooncakeReceiver"),
}


def register(name: str, way: Way) -> None:
    """Add a transport (or replace one) under ``name``, the name a HELLO carries."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"transport name {name!r}: lower-case letters, digits, '_' or '-', at most 32")
    REGISTRY[name] = way


def way(name: str) -> Way:
    """The registered transport ``name``, or a ValueError naming the ones there are."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r} (one of {', '.join(REGISTRY)})") from None


def make_sender(name: str, **kw: object) -> Sender:
    return way(name).sender_class()(**kw)


def make_receiver(name: str, **kw: object) -> Receiver:
    return way(name).receiver_class()(**kw)


def senders_from_settings(s: Settings) -> dict[str, Sender]:
    """The sidecar's senders: each registered transport that its settings configure (each
    sender class decides, :meth:`Sender.from_settings`), started now so that a missing package
    or an address it cannot use stops the sidecar at start-up with the reason."""
    out: dict[str, Sender] = {}
    for name, w in REGISTRY.items():
        sender = w.sender_class().from_settings(s)
        if sender is not None:
            out[name] = sender
    return out


def receiver_from_settings(name: str, s: Settings, endpoint: str) -> Receiver:
    """A trainer's receiver for transport ``name``, its options from the settings (and, where it
    needs one, the sidecar's ``endpoint``: Mooncake's address towards it)."""
    return way(name).receiver_class().from_settings(s, endpoint)


__all__ = ["REGISTRY", "Receiver", "Sender", "TransportError", "Way", "make_receiver", "make_sender",
           "receiver_from_settings", "register", "senders_from_settings", "way"]
