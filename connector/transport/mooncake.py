"""Mooncake Transfer Engine: the trainer reads a sample's bytes straight from the producing
host's memory (TCP here, RDMA where the hardware has it), never through the sidecar's socket.

The sidecar's :class:`MooncakeSender` maps a leased sample's spool file read-only, registers the
mapping with its engine and sends its address and length in the DELIVER; the engine's own
threads serve the read. The trainer's :class:`MooncakeReceiver` reads into one registered buffer
(grown as needed), the stream verifies the checksum, and its RECEIVED makes the sidecar
unregister, unmap and delete the file. A region is registered only while its sample is leased to
a Mooncake trainer: an unregistered address is refused by the serving engine.

Engines meet point to point (Mooncake's ``P2PHANDSHAKE``): no metadata service to run. Mooncake
itself neither authenticates nor encrypts its TCP transport: keep its ports on a private network
(docs/multi-host.md); the descriptors travel on the CURVE-protected control connection.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from connector.contract import messages as M
from connector.transport import Receiver, Sender, TransportError

if TYPE_CHECKING:
    from connector.contract.settings import Settings

log = logging.getLogger("hsstream.transport")

INSTALL_HINT = ("pip install 'hidden-state-stream[mooncake]' (the package mooncake-transfer-engine-non-cuda, "
                "or mooncake-transfer-engine on CUDA hosts; it needs the OS's libibverbs1)")  # fmt: skip
#: The header and token ids a file holds beyond its hidden states: a DELIVER asking us to read
#: more than this past the notice's ``nbytes`` is refused instead of allocating what it says.
_MAX_EXTRA_BYTES = 1 << 20


class Transfer(BaseModel):
    """Where a Mooncake reader finds a sample's bytes on the producing host: the engine's
    session (``host:port`` of its P2P handshake), the registered address and the length. Only
    the bytes travel through the engine; this descriptor rides in the DELIVER
    (``Deliver.transfer``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session: str = Field(min_length=3, max_length=300)
    addr: int = Field(gt=0)
    nbytes: int = Field(ge=8)


def start_engine(hostname: str, protocol: str = "tcp", device: str = ""):  # noqa: ANN201
    """A started TransferEngine and its session name (``host:port``), point to point."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransportError(f"transport 'mooncake' needs the Mooncake Transfer Engine ({e}): {INSTALL_HINT}") from e
    engine = TransferEngine()
    rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise TransportError(f"Mooncake Transfer Engine did not start on {hostname!r} over {protocol} (code {rc})")
    return engine, f"{hostname}:{engine.get_rpc_port()}"


def local_address_towards(endpoint: str) -> str:
    """This host's address on the route to ``endpoint``'s host (tcp://host:port), which the
    other side can reach; 127.0.0.1 for ipc:// or when there is no route."""
    host = urlsplit(endpoint).hostname if endpoint.startswith("tcp://") else None
    if not host or host in ("0.0.0.0", "*"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: nothing is sent, the kernel only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


@dataclass
class _Region:
    owner: bytes
    mm: mmap.mmap
    view: np.ndarray  # holds the address; dropped before the mapping is closed
    nbytes: int

    @property
    def addr(self) -> int:
        return int(self.view.ctypes.data)


class MooncakeSender(Sender):
    name = "mooncake"

    def __init__(self, hostname: str, protocol: str = "tcp", device: str = "") -> None:
        self.engine, self.session = start_engine(hostname, protocol, device)
        self._regions: dict[M.SampleKey, _Region] = {}
        log.info("Mooncake transfer engine serving spool files at %s over %s", self.session, protocol)

    @classmethod
    def from_settings(cls, s: Settings) -> MooncakeSender | None:
        """Offered only when ``HSSTREAM_MOONCAKE_HOSTNAME`` names this host's address for it."""
        if not s.mooncake_hostname:
            return None
        return cls(s.mooncake_hostname, s.mooncake_protocol, s.mooncake_device)

    @property
    def registered(self) -> int:
        """Regions registered now (bounded by the Mooncake trainers' credit)."""
        return len(self._regions)

    def offer(self, owner: bytes, key: M.SampleKey, path: Path | None) -> tuple[M.Descriptor | None, bytes | None]:
        r = self._regions.get(key)
        if r is None:
            assert path is not None
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                size = os.fstat(fd).st_size
                if size < 8:
                    raise OSError(f"{path}: {size}-byte file")
                mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            r = _Region(owner, mm, np.frombuffer(mm, dtype=np.uint8), size)
            rc = self.engine.register_memory(r.addr, size)
            if rc != 0:
                self._close(r)
                raise TransportError(f"Mooncake could not register {size} bytes of {path.name} (code {rc})")
            self._regions[key] = r
        r.owner = owner
        return Transfer(session=self.session, addr=r.addr, nbytes=r.nbytes).model_dump(), None

    def release(self, key: M.SampleKey) -> None:
        r = self._regions.pop(key, None)
        if r is not None:
            self.engine.unregister_memory(r.addr)
            self._close(r)

    def release_owner(self, owner: bytes) -> None:
        for key in [k for k, r in self._regions.items() if r.owner == owner]:
            self.release(key)

    def close(self) -> None:
        for key in list(self._regions):
            self.release(key)

    @staticmethod
    def _close(r: _Region) -> None:
        del r.view
        r.mm.close()


class MooncakeReceiver(Receiver):
    name = "mooncake"

    def __init__(self, hostname: str, protocol: str = "tcp", device: str = "", retries: int = 3) -> None:
        self.engine, self.session = start_engine(hostname, protocol, device)
        self.retries = max(1, retries)
        self._buf: np.ndarray | None = None

    @classmethod
    def from_settings(cls, s: Settings, endpoint: str) -> MooncakeReceiver:
        """This host's address is ``HSSTREAM_MOONCAKE_HOSTNAME``, else the one on the route to
        the sidecar at ``endpoint``."""
        return cls(s.mooncake_hostname or local_address_towards(endpoint), s.mooncake_protocol, s.mooncake_device)

    def _buffer(self, n: int) -> np.ndarray:
        if self._buf is None or self._buf.nbytes < n:
            if self._buf is not None:
                self.engine.unregister_memory(int(self._buf.ctypes.data))
            self._buf = np.empty(max(n, 2 * (self._buf.nbytes if self._buf is not None else 0), 1 << 20), np.uint8)
            rc = self.engine.register_memory(int(self._buf.ctypes.data), self._buf.nbytes)
            if rc != 0:
                self._buf = None
                raise TransportError(f"Mooncake could not register a {n}-byte receive buffer (code {rc})")
        return self._buf

    def fetch(self, d: M.Deliver, frame: bytes | None) -> bytes | memoryview | None:
        if d.transfer is None:
            raise M.ProtocolError("a DELIVER without a Mooncake transfer descriptor")
        try:
            t = Transfer.model_validate(d.transfer)
        except ValidationError as e:
            raise M.ProtocolError(f"bad Mooncake transfer descriptor: {e}") from e
        limit = d.notice.nbytes + 8 * d.notice.num_tokens + _MAX_EXTRA_BYTES
        if t.nbytes > limit:
            raise M.ProtocolError(f"transfer of {t.nbytes} bytes for a {d.notice.nbytes}-byte sample")
        buf = self._buffer(t.nbytes)
        for i in range(self.retries):
            rc = self.engine.transfer_sync_read(t.session, int(buf.ctypes.data), t.addr, t.nbytes)
            if rc == 0:
                return memoryview(buf)[: t.nbytes]
            time.sleep(0.1 * (i + 1))
        raise TransportError(
            f"Mooncake read of {t.nbytes} bytes from {t.session} failed {self.retries} times (code {rc}): can this "
            "host reach the sidecar host's Mooncake ports (HSSTREAM_MOONCAKE_HOSTNAME on the sidecar)?"
        )

    def close(self) -> None:
        if self._buf is not None:
            self.engine.unregister_memory(int(self._buf.ctypes.data))
            self._buf = None
