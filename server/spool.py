"""The sidecar's side of the spool: what may be deleted, and the reaper for what leaked.

Only the connector's own names (``protocol.is_own_name``) in a spool that carries our marker
(``protocol.claim_spool``) are ever touched: a spool pointed at a model folder deletes nothing. A file is garbage when
no READY/LEASED sample names it, it is older than the grace period, and no SUBMITTED sample
waits for its notice (the notice in its header names the sample's current attempt): however
late a notice is, its file is still there. Temp files are garbage once their writer had ample
time. Killed processes (connector,
trainer, sidecar) therefore never leave /dev/shm filling up for long.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from connector import protocol as P
from connector.contract.arena import ARENA_NAME
from server.ledger import Ledger

log = logging.getLogger("hsstream.sidecar")


class SpoolKeeper:
    def __init__(self, spool: Path, ledger: Ledger, *, interval_s: float = 10.0, grace_s: float = 60.0) -> None:
        self.spool = spool
        self.ledger = ledger
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.removed_total = 0

    def exists(self, name: str) -> bool:
        return P.spool_file_exists(self.spool, name)

    def remove(self, names: Iterable[str]) -> int:
        n = sum(P.remove_from_spool(self.spool, name) for name in names)
        self.removed_total += n
        return n

    def file_bytes(self) -> int:
        total = 0
        for e in os.scandir(self.spool):
            if e.name.startswith(ARENA_NAME):
                continue  # the arena's size is its budget, not samples: /v1/stats shows its slots
            try:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
        return total

    def sweep(self, min_age_s: float | None = None) -> int:
        """Remove files no live sample owns; ``min_age_s=0`` at start-up, when nothing is in flight."""
        age = self.grace_s if min_age_s is None else min_age_s
        if not P.is_marked_spool(self.spool):
            log.error("spool %s lost its %s marker: not sweeping it", self.spool, P.SPOOL_MARKER)
            return 0
        live = self.ledger.live_files()
        now = time.time()
        gone = 0
        for e in os.scandir(self.spool):
            name = e.name
            if name in live or not P.is_own_name(name):
                continue
            try:
                st = e.stat(follow_symlinks=False)
                if not e.is_file(follow_symlinks=False) or now - st.st_mtime < age:
                    continue
                if P.is_own_lock_name(name):
                    # A lock goes with its file (removed with it); alone, it is stray only once
                    # its writer let go of it (a held flock is a write in progress).
                    data = name[: -len(P.LOCK_SUFFIX)]
                    if data in live or os.path.lexists(os.path.join(self.spool, data)):
                        continue
                    if not P.lock_is_free(os.path.join(self.spool, name)):
                        continue
                    os.unlink(os.path.join(self.spool, name))
                elif P.is_tmp_name(name):
                    os.unlink(os.path.join(self.spool, name))
                elif self._awaits_its_notice(os.path.join(self.spool, name)):
                    continue  # written and renamed, its notice still on the way: the sample's
                elif not P.remove_from_spool(self.spool, name):  # the file and its lock
                    continue
                gone += 1
                if min_age_s is None and not P.is_tmp_name(name) and not P.is_own_lock_name(name):
                    # A finished file nobody owned for the whole grace: its notice was lost (a
                    # connector or sidecar killed) or a ledger path forgot it. Loud, with its age,
                    # so a leak shows in the log rather than only as a full spool.
                    log.warning("reaped stray spool file %s, %.0f s old: no sample owned it (lost notice?)",
                                name, now - st.st_mtime)  # fmt: skip
                else:
                    log.info("reaped stray spool file %s", name)
            except FileNotFoundError:
                pass
        self.removed_total += gone
        return gone

    def _awaits_its_notice(self, path: str) -> bool:
        """True if the notice in the file's header names a sample still SUBMITTED at that
        attempt: its notice comes after the rename (a busy sidecar, a connector's notice thread
        restarting), and the file must be there when it does. Once the sample moves on (notice
        timeout, new attempt), the file is garbage like any other."""
        n = _header_notice(path)
        return n is not None and n.key is not None and self.ledger.awaits_notice(n.key, n.attempt)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self.sweep)
            except Exception:  # noqa: BLE001 - the reaper must outlive a bad scan
                log.exception("spool sweep failed")


#: The most header bytes read to find a stray file's notice (ours are a few kB).
_MAX_HEADER = 1 << 20


def _header_notice(path: str) -> P.Notice | None:
    """The notice our connector wrote into a file's safetensors header; None for anything else
    (not safetensors, no notice, unreadable)."""
    try:
        with open(path, "rb") as f:
            hlen = int.from_bytes(f.read(8), "little")
            if not 0 < hlen <= _MAX_HEADER:
                return None
            header = json.loads(f.read(hlen))
        return P.Notice.decode(header["__metadata__"][P.HEADER_NOTICE_KEY])
    except (OSError, ValueError, KeyError, TypeError, RecursionError, P.ProtocolError):
        return None
