"""The sidecar's notice endpoint: connectors push, one thread here pulls.

A notice is input from another process: it is decoded strictly and its file name checked
against the spool before anything is touched. A notice naming a path outside the spool is
refused and logged; its "file" is left alone, since it is not ours.

The notices that have arrived together (up to ``GROUP_MAX``) go into the ledger as one group: one
commit for all of them, and the files of refused ones deleted only after it. A notice that made
its sample READY wakes the delivery thread (``wake_delivery``), which offers the sample to the
trainers as soon as the group's commit releases the ledger's lock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from connector import layouts as L
from connector import protocol as P
from server.ledger import GROUP_MAX, Ledger, NoticeOutcome
from server.socket_thread import SocketThread

log = logging.getLogger("hsstream.sidecar")


def prepare_ipc(endpoint: str) -> None:
    """Create the directory of an ipc:// endpoint, private to this user (ipc has no auth)."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):  # an abstract socket has no directory
        d = Path(endpoint[len("ipc://") :]).parent
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise PermissionError(
                f"{d} (socket directory of {endpoint}) must belong to this user and not be writable by "
                f"others: anyone who can write there can inject notices (mode {oct(st.st_mode & 0o777)})"
            )


class NoticeReceiver(SocketThread):
    name = "hsstream-notices"

    def __init__(
        self, endpoint: str, spool: Path, ledger: Ledger, max_message_bytes: int = 1 << 20, *,
        observe: Callable[[P.Notice], object] | None = None, wake_delivery: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        """``max_message_bytes``: the largest notice accepted; ZeroMQ drops the connection of a
        peer that sends more before anything is parsed (a notice is a few kB of JSON).
        ``observe``: sees each checked notice before the ledger does (the sample size is learned
        from it). ``wake_delivery``: rung for each notice that made its sample READY."""
        super().__init__()
        self.max_message_bytes = max_message_bytes
        self.endpoint = endpoint
        self.spool = spool
        self.ledger = ledger
        self.stats = {"notices": 0, "refused": 0, "deleted": 0, "foreign": 0}
        self.observe = observe
        self.wake_delivery = wake_delivery
        self.last_notice_at: float | None = None  # monotonic time of the latest well-formed notice

    def bind(self) -> zmq.Socket:
        prepare_ipc(self.endpoint)
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.bind(self.endpoint)
        return sock

    def serve(self, sock: zmq.Socket) -> None:  # type: ignore[override]
        try:
            while not self.stopping:
                if sock.poll(200):
                    raws = [sock.recv()]
                    arrived = time.time()
                    while len(raws) < GROUP_MAX:
                        try:
                            raws.append(sock.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                    self.handle_batch(raws, arrived)
        finally:
            sock.close()

    def handle(self, raw: bytes) -> None:
        self.handle_batch([raw])

    def handle_batch(self, raws: list[bytes], arrived: float | None = None) -> None:
        """Apply notices in one ledger group; delete the files it refused once that is on disk.
        ``arrived``: ``time.time()`` they were read off the socket (default: now).

        The delivery thread is rung as each sample becomes READY, inside the group: it wakes,
        waits for the lock and leases once the commit is on disk (ringing after the commit
        instead was measured no faster: docs/benchmarks.md, the sidecar's hop)."""
        arrived = time.time() if arrived is None else arrived
        delete: list[str] = []
        try:
            with self.ledger.group():
                for raw in raws:
                    try:
                        outcome, name = self._apply(raw, arrived)
                    except Exception:  # noqa: BLE001 - one bad notice must not end the thread
                        log.exception("notice handling failed")
                        continue
                    if outcome is NoticeOutcome.ready and self.wake_delivery is not None:
                        self.wake_delivery()  # the delivery thread acts next: it offers the sample
                    if name is not None:
                        delete.append(name)
        except Exception:  # noqa: BLE001 - the commit failed: keep the files, the notice timeout settles them
            log.exception("writing %d notice(s) to the ledger failed", len(raws))
            return
        for name in delete:
            self.stats["deleted"] += 1
            P.remove_from_spool(self.spool, name)

    def _apply(self, raw: bytes, arrived: float) -> tuple[NoticeOutcome | None, str | None]:
        """One notice into the ledger: what the ledger made of it (None: not given to it), and
        its file if the ledger refused it (to delete)."""
        self.stats["notices"] += 1
        try:
            n = P.Notice.decode(raw)
        except P.ProtocolError as e:
            self.stats["refused"] += 1
            log.error("refused notice: %s", e)
            return None, None
        self.last_notice_at = time.monotonic()  # a connector is talking (readyz: notices_stopped)
        path = None
        if n.file is not None and n.slot is not None:
            self.stats["refused"] += 1
            log.error("refused notice for %s: it names both a file and a slot", n.request_id)
            return None, None
        if n.file is not None:
            try:
                if not P.is_own_name(n.file) or P.is_tmp_name(n.file) or P.is_own_lock_name(n.file):
                    raise P.UnsafePathError(f"refusing {n.file!r}: not a name the connector writes ({P.FILE_PREFIX}…)")
                path = P.resolve_in_spool(self.spool, n.file)
            except (P.UnsafePathError, FileNotFoundError) as e:
                # Refused without touching the sample: a notice naming a file we cannot use may
                # come from anyone, and must not cost a real sample an attempt (a flood of them
                # would fail it). The sample's own notice, or the notice timeout, settles it.
                self.stats["refused"] += 1
                why = e if isinstance(e, P.UnsafePathError) else f"file {n.file} missing"
                log.error("refused notice for %s (key %s, attempt %d): %s", n.request_id, n.key, n.attempt, why)
                return None, None
        if n.key is None:
            # A request that did not come through us (drop-in use of the connector): not ours.
            self.stats["foreign"] += 1
            return None, None
        try:
            # What the sample holds of the spool, as its layout counts it: the file's size, or the
            # length of its arena slot (the ledger checks the slot is this attempt's).
            size = L.held_bytes(n, path) if n.status == P.NoticeStatus.ok else 0
        except FileNotFoundError:  # gone between the check and now (reaped, or deleted by hand)
            n, path, size = n.model_copy(update={"status": P.NoticeStatus.error, "reason": "file vanished"}), None, 0
        if n.sent_at is not None:
            # For the trainer's latency breakdown (one host's clock): connector -> here.
            n = n.model_copy(update={"timings": {**n.timings, P.TIMING_SIDECAR_IN: round(arrived - n.sent_at, 6)}})
        if self.observe is not None:
            self.observe(n)  # e.g. the sample size, learned before the ledger frees the sample's estimate
        outcome = self.ledger.on_notice(n, size)
        return outcome, (n.file if not outcome.keeps_file and path is not None else None)
