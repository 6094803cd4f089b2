"""How a sample's bytes lie in the spool: one interface, a registry of the layouts.

Shaped like :mod:`connector.transport`. The control plane (notices, credit, leases, the
ledger's states) does not care where a sample's hidden states sit in ``/dev/shm``; only this
package does. Each layout has three halves, one per process that touches the bytes:

* a :class:`SidecarHalf` in the sidecar: sets the spool up at start-up (``open``: the arena
  file, the ledger's allocator of placements), says how many bytes of the spool a notice's
  sample holds (``held_bytes``), and hands a remote trainer the bytes of a sample that is not
  a spool file (``payload_of``); which transports it can serve (``served_transports``);
* a :class:`WriterHalf` in the connector's writer: where the copy lands and the commit
  (``write``: file renamed into place, or slot header written last), what every notice of its
  samples names (``notice_fields``), and, optionally, a gather straight into the placement
  from the engine's step (``gather``);
* a :class:`ReaderHalf` in the trainer's stream: a notice opened into tensors (``open``) and
  whether their release waits for the tensors' views to die (``holds_views``: a slot) or is
  the file's deletion once checked.

=======  =========================================  ==========================================
name     a sample is                                 its placement on the wire
=======  =========================================  ==========================================
files    one safetensors file in the spool           ``file`` (its name)
arena    a slot of one shared-memory arena file      ``slot`` (``connector.contract.arena.Slot``)
=======  =========================================  ==========================================

The sidecar runs one layout (``HSSTREAM_SPOOL_LAYOUT``, :func:`sidecar_from_settings`), but a
sample's layout is read from the sample itself, by its placement: the writer and the trainer
ask :func:`of_sample` (the one layout whose ``claims`` accepts the tag or the notice, else
``files``, the drop-in default), so neither needs the sidecar's setting, and a sample too
large for the arena (the sidecar gives it a file) is read as a file.

A layout is one module with its three halves plus one line in :data:`REGISTRY` (name →
module and class names). A module is imported only when a half is asked for. Outside this
package only this registry and the settings name a layout module or what it defines
(``tests/unit/project/test_layout_boundary.py``).
"""

from __future__ import annotations

import functools
import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connector.contract import messages as M

if TYPE_CHECKING:
    import torch

    from connector.contract.settings import Settings

_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
#: The layout of a sample no other layout claims (what drop-in clients and plain vLLM get).
DEFAULT = "files"


class SidecarHalf(ABC):
    """The sidecar's half. Built once at start-up (:func:`sidecar_from_settings`), opened before
    the ledger recovers, so that the placements the ledger's rows still hold are reserved again."""

    name: str
    #: Transports a trainer may ask of a sidecar of this layout (None: every one it offers).
    served_transports: tuple[str, ...] | None = None
    #: The type of what this layout reserves for a sample (the arena: a ``Slot``), which the
    #: ledger keeps in its row as opaque text (:func:`encode_placement`); None: nothing is
    #: reserved (the connector names the sample's file itself).
    placement_type: type | None = None

    @classmethod
    def from_settings(cls, s: Settings) -> SidecarHalf:
        return cls()

    def open(self, spool: Path, settings: Settings, ledger: Any) -> None:
        """Make the spool's storage and attach the ledger's allocator of placements (none for a
        layout whose placement is a file the connector names itself)."""

    @staticmethod
    def held_bytes(n: M.Notice, path: Path | None) -> int:
        """Spool bytes an ok notice's sample holds (what the ledger reserves for it until freed):
        the file's size by default."""
        return path.stat().st_size if path is not None else 0

    @staticmethod
    def encode_placement(placement: Any) -> str:
        """A placement of this layout as text (the ledger's row holds it, prefixed by the name)."""
        raise NotImplementedError

    @staticmethod
    def decode_placement(text: str) -> Any:
        """What :meth:`encode_placement` wrote, back."""
        raise NotImplementedError

    def payload_of(self, n: M.Notice) -> bytes | None:
        """A remote trainer's bytes of a leased sample (what a file would hold), or None when
        the sample is a spool file, which the transport's sender opens itself. OSError: its
        bytes cannot be read (the sample is produced again)."""
        if n.file is None:
            raise OSError(f"a sample without a file, and this sidecar's layout ({self.name}) has no other placement")
        return None

    def close(self) -> None:
        pass


def encode_placement(placement: Any) -> str:
    """A sample's placement as the ledger stores it, opaque to the ledger: ``<layout>:<text>``,
    the text its layout's sidecar half writes (the ledger's ``samples.placement``, schema 5)."""
    for name, lay in REGISTRY.items():
        cls = lay.sidecar_class()
        if cls.placement_type is not None and isinstance(placement, cls.placement_type):
            return f"{name}:{cls.encode_placement(placement)}"
    raise ValueError(f"no registered spool layout places a {type(placement).__name__}")


def decode_placement(text: str) -> Any:
    """The placement :func:`encode_placement` stored, decoded by the layout its prefix names."""
    name, sep, rest = text.partition(":")
    if not sep:
        raise ValueError(f"a placement names its layout first ('<layout>:…'), not {text[:40]!r}")
    return layout(name).sidecar_class().decode_placement(rest)


class WriterHalf(ABC):
    """The connector writer's half, one instance per :class:`~connector.spool_writer.SpoolWriter`
    (it may keep a mapping of the spool). ``write`` runs on a writer thread; ``gather`` on the
    engine's step and must return at once."""

    name: str

    def __init__(self, spool: Path) -> None:
        self.spool = Path(spool)

    @staticmethod
    def claims(tag: M.RequestTag | None, file: str | None) -> bool:
        """Whether a sample of this tag (and spool file name) is this layout's."""
        return False

    def notice_fields(self, tag: M.RequestTag | None) -> dict[str, Any]:
        """What every notice of this sample names (ok, error or busy): its placement."""
        return {}

    @staticmethod
    def kv_params(tag: M.RequestTag | None, spool_dir: str | Path, file: str) -> dict[str, Any]:
        """What vLLM's response tells the client of where the sample will be (by the scheduler's
        side, which has no writer): the spool file's path, as vLLM's Example connector does."""
        return {M.KV_PARAMS_PATH_KEY: f"{spool_dir}/{file}", "hsstream_file": file}

    def gather(self, worker: Any, p: Any, tag: M.RequestTag, t0: float) -> bool:
        """Start the engine's copy of ``p``'s rows straight into the placement and hand the write
        to the writer (True), or leave the gather to the worker (False: into host memory)."""
        return False

    def copies_in_place(self, worker: Any, p: Any) -> bool:
        """Whether ``gather`` puts ``p``'s rows into the placement with no host memory of the
        writer's (the writer's bound then counts none for it)."""
        return False

    @abstractmethod
    def write(self, writer: Any, job: Any) -> M.Notice:
        """The copy into the placement and its commit (nothing visible before it is complete);
        returns the notice to publish: ok, or an error/busy one for every failure."""

    def close(self) -> None:
        pass


class ReaderHalf(ABC):
    """The trainer's half, one instance per stream (it may keep a mapping of the spool). Called
    from the stream's check workers (``open``) and its iterating thread."""

    name: str
    #: The sample's release waits for every view of its tensors to die (its RECEIVED then goes),
    #: and the trainer never deletes it; else the trainer deletes the checked file itself.
    holds_views: bool = False
    #: Bytes read in place need no checksum (their one writer held the placement's lease).
    trusted_in_place: bool = False

    def __init__(self, spool: Path | None) -> None:
        self.spool = Path(spool) if spool is not None else None

    @staticmethod
    def claims(n: M.Notice) -> bool:
        """Whether the sample of this notice is this layout's."""
        return False

    @abstractmethod
    def open(self, n: M.Notice, *, pin_memory: bool, alloc: Callable[[int], torch.Tensor] | None,
             device: torch.device | None, timings: dict[str, float], on_header: Callable | None,
             on_release: Callable[[], None] | None) -> dict[str, torch.Tensor]:  # fmt: skip
        """The sample's tensors read from the spool (``on_release``: called once no view of a
        held placement is left). Raises ``InvalidSample`` for bytes that are not the notice's."""

    def where(self, n: M.Notice) -> str:
        """The placement, for a log line."""
        return str(n.file)

    def close(self) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _load(module: str, name: str) -> type:
    """A half's class, imported once: :func:`of_sample` asks every layout per sample, on the
    engine's step, the notice loop and the stream's checks."""
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Layout:
    """One layout in the registry: the module holding its halves (imported only when one is
    built) and the names of its :class:`SidecarHalf`, :class:`WriterHalf` and :class:`ReaderHalf`
    classes there."""

    module: str
    sidecar: str
    writer: str
    reader: str

    def _cls(self, name: str) -> type:
        return _load(self.module, name)

    def sidecar_class(self) -> type[SidecarHalf]:
        return self._cls(self.sidecar)

    def writer_class(self) -> type[WriterHalf]:
        return self._cls(self.writer)

    def reader_class(self) -> type[ReaderHalf]:
        return self._cls(self.reader)


#: Every layout, by the name ``HSSTREAM_SPOOL_LAYOUT`` gives. Adding one is its module plus one line here.
REGISTRY: dict[str, Layout] = {
    "files": Layout("connector.layouts.files", "FilesSidecar", "FilesWriter", "FilesReader"),
    "arena": Layout("connector.layouts.arena", "ArenaSidecar", "ArenaWriter", "ArenaReader"),
}


def register(name: str, layout: Layout) -> None:
    """Add a layout (or replace one) under ``name``."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"spool layout name {name!r}: lower-case letters, digits, '_' or '-', at most 32")
    REGISTRY[name] = layout


def layout(name: str) -> Layout:
    """The registered layout ``name``, or a ValueError naming the ones there are."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown spool layout {name!r} (one of {', '.join(REGISTRY)})") from None


def of_sample(*, tag: M.RequestTag | None = None, file: str | None = None, notice: M.Notice | None = None) -> str:
    """The name of a sample's layout, read from its placement: the layout whose writer half
    claims (``tag``, ``file``) or whose reader half claims ``notice``; :data:`DEFAULT` if none does."""
    for name, lay in REGISTRY.items():
        if name == DEFAULT:
            continue
        if notice is not None:
            if lay.reader_class().claims(notice):
                return name
        elif lay.writer_class().claims(tag, file):
            return name
    return DEFAULT


def sidecar_from_settings(s: Settings) -> SidecarHalf:
    """The sidecar's half of the layout its settings name (``HSSTREAM_SPOOL_LAYOUT``)."""
    return layout(s.spool_layout).sidecar_class().from_settings(s)


def held_bytes(n: M.Notice, path: Path | None) -> int:
    """Spool bytes an ok notice's sample holds, as its layout counts them."""
    return layout(of_sample(notice=n)).sidecar_class().held_bytes(n, path)


class Writers:
    """A writer's halves, one per layout met, built at a layout's first sample."""

    def __init__(self, spool: Path) -> None:
        self.spool = Path(spool)
        self._halves: dict[str, WriterHalf] = {}

    def get(self, name: str) -> WriterHalf:
        h = self._halves.get(name)
        if h is None:
            h = self._halves.setdefault(name, layout(name).writer_class()(self.spool))
        return h

    def of(self, tag: M.RequestTag | None, file: str | None = None) -> WriterHalf:
        return self.get(of_sample(tag=tag, file=file))

    def close(self) -> None:
        for h in self._halves.values():
            h.close()


class Readers:
    """A stream's halves, one per layout met, built at a layout's first sample. ``options``: per
    layout name, keyword arguments its reader half is built with."""

    def __init__(self, spool: Path | None, options: dict[str, dict[str, Any]] | None = None) -> None:
        self.spool = spool
        self.options = options or {}
        self._halves: dict[str, ReaderHalf] = {}

    def get(self, name: str) -> ReaderHalf:
        h = self._halves.get(name)
        if h is None:
            h = self._halves.setdefault(name, layout(name).reader_class()(self.spool, **self.options.get(name, {})))
        return h

    def of(self, n: M.Notice) -> ReaderHalf:
        return self.get(of_sample(notice=n))

    def close(self) -> None:
        for h in list(self._halves.values()):
            h.close()


def holds_views(n: M.Notice) -> bool:
    """Whether the release of this notice's sample waits for its tensors' views to die."""
    return layout(of_sample(notice=n)).reader_class().holds_views


__all__ = ["DEFAULT", "REGISTRY", "Layout", "ReaderHalf", "Readers", "SidecarHalf", "WriterHalf", "Writers",
           "decode_placement", "encode_placement", "held_bytes", "holds_views", "layout", "of_sample", "register", "sidecar_from_settings"]
