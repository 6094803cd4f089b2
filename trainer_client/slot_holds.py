"""The arena layout's slots on the trainer's side: which delivered slots this stream may still
use, and when each one's RECEIVED may go (``stream.py``'s module docstring says why it waits).

A slot delivery gets a hold before its reader maps it; the reader's finalizer (any thread, once no
view of the slot is left) only queues the hold's id; the stream's iterating thread, which alone
owns the socket, drains that queue and sends the RECEIVED of every hold that is both checked
(``settled``) and released, with every lease token the slot was delivered with. A refused slot's
hold is dropped at once, and its late release sends nothing. Kept apart from the stream so the
client (socket, credit, leases, acks) reads without the arena's bookkeeping in between.
"""

from __future__ import annotations

import functools
import itertools
import queue
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from connector.contract import messages as M
from connector import layouts as L


@dataclass(eq=False)
class SlotHold:
    """One delivered arena slot while this trainer may use its bytes: read by a worker, checked
    (``settled``) or refused (``dead``), and ``released`` once no view is left (its hold let go).
    Its RECEIVED (every token it was delivered with) goes when it is both settled and released."""

    key: M.SampleKey
    tokens: list[str]
    settled: bool = False
    released: bool = False
    dead: bool = False
    sample: Any = None  # a weak reference to the yielded Sample (copy_out_yielded() copies what it still views)


def is_slot(d: M.Deliver) -> bool:
    """A delivery whose spool layout holds it while its views live (the arena's slot, no file:
    ``ReaderHalf.holds_views``), so its RECEIVED waits for them."""
    return L.holds_views(d.notice)


class SlotHolds:
    """The holds of one stream. Every method but the ``on_release`` that :meth:`hold` returns runs
    on the stream's iterating thread; ``send`` is the stream's (it queues a message for the socket)."""

    def __init__(self, send: Callable[[M.Received], None]) -> None:
        self._send = send
        self._holds: dict[int, SlotHold] = {}
        self._of_key: dict[M.SampleKey, int] = {}
        self._released: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._ids = itertools.count(1)

    @property
    def waiting(self) -> int:
        """Slots of checked samples whose RECEIVED waits for their views to go."""
        return sum(1 for h in self._holds.values() if h.settled and not h.released)

    def hold(self, d: M.Deliver) -> Callable[[], None]:
        """A new hold for a slot delivery; returns the ``on_release`` its reader calls once no
        view of the slot is left (it only queues the hold's id: it may run on any thread). The
        reader calls it for every slot it read or refused; one it could not hold is settled
        (:meth:`settle`)."""
        hid = next(self._ids)
        h = SlotHold(d.notice.key, [d.token])  # type: ignore[arg-type]
        self._holds[hid] = h
        self._of_key[h.key] = hid
        return functools.partial(self._released.put, hid)

    def drain(self) -> None:
        """The slots whose views are gone (queued by their finalizers): RECEIVED for the checked
        ones; a refused one's hold is dropped."""
        while True:
            try:
                hid = self._released.get_nowait()
            except queue.Empty:
                return
            h = self._holds.get(hid)
            if h is None:
                continue
            h.released = True
            if h.settled:
                self._received(hid)
            elif h.dead:
                self._forget(hid)

    def settle(self, d: M.Deliver, ok: bool, sample: Any = None) -> bool:
        """A slot delivery's check is over: ``ok``, its RECEIVED goes once its views are gone
        (now, if it was copied out), and ``sample`` (the yielded one) is remembered for
        :meth:`copy_out_yielded`; else it was refused (FAIL) and its release sends nothing.
        False: no hold of that key (nothing done)."""
        hid = self._of_key.get(d.notice.key)  # type: ignore[arg-type]
        if hid is None:
            return False
        self.drain()
        h = self._holds[hid]
        if ok:
            if sample is not None:
                h.sample = weakref.ref(sample)
            h.settled = True
            if h.released:
                self._received(hid)
        else:
            h.dead = True
            self._forget(hid)  # a late finalizer finds no hold: nothing is sent
        return True

    def add_copy(self, d: M.Deliver) -> bool:
        """Another copy of a held slot's delivery (a redelivery while the first is in use): its
        token goes with the first one's RECEIVED (the sidecar frees the slot on either). False:
        no hold of that key."""
        hid = self._of_key.get(d.notice.key)  # type: ignore[arg-type]
        if hid is None:
            return False
        self._holds[hid].tokens.append(d.token)
        return True

    def copy_out_yielded(self) -> None:
        """At close: the yielded samples that still view their slots get private copies of those
        tensors (the Sample's fields replaced), so the loop may go on using them after the stream
        is gone and their slots' RECEIVEDs still go now. Tensors the loop took out of a sample
        itself (``h = x.hidden_states``) keep their slot until the sidecar drops this trainer."""
        for h in list(self._holds.values()):
            smp = h.sample() if h.sample is not None else None
            if smp is None or not h.settled or h.released:
                continue
            for name in ("hidden_states", "token_ids", "scales"):
                t = getattr(smp, name, None)
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    object.__setattr__(smp, name, t.clone())  # (a view's set_ would keep its base)
            del smp, t

    def _forget(self, hid: int) -> SlotHold:
        h = self._holds.pop(hid)
        if self._of_key.get(h.key) == hid:
            del self._of_key[h.key]
        return h

    def _received(self, hid: int) -> None:
        """A checked slot's bytes are no longer used: RECEIVED (every token it came with)."""
        h = self._forget(hid)
        self._send(M.Received(keys=[h.key] * len(h.tokens), tokens=h.tokens))
