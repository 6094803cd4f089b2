"""A share of the original dataset beside the live traffic (``hsstream train --follow --mix FILE
--mix-share S``), so a draft trained on what a deployment is asked now does not forget what it
learnt before.

A thread of the trainer's process (rank 0) watches the sidecar's jobs: everything that arrives
after the run started and is not its own is traffic (the proxy's traffic jobs). It keeps its
own samples at ``S / (1 - S)`` of the traffic's by uploading rows of ``FILE`` in small jobs
(``batch`` rows, read in a shuffled cycle through the file: each pass a new seed), so the stream
the trainer follows holds about ``S`` of the original data whatever the traffic's rate, and
nothing when there is no traffic. Its job ids go to ``OUT/mix_jobs.json``. A sidecar that does
not answer is tried again at the next look; nothing here can stop the training.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("hsstream.train")


def mix_target(traffic: int, share: float) -> float:
    """Samples of the original data that make ``share`` of the whole beside ``traffic`` samples."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"--mix-share must be in [0, 1), got {share!r}")
    return traffic * share / (1.0 - share)


class Mixer(threading.Thread):
    def __init__(self, client_factory: Callable[[], object], rows: Callable[[int], Iterator[dict]], share: float,
                 out_dir: str | Path, *, batch: int = 32, every_s: float = 5.0, options: dict | None = None) -> None:  # fmt: skip
        super().__init__(name="hsstream-mixer", daemon=True)
        mix_target(0, share)
        self.share, self.batch, self.every_s = share, max(1, batch), every_s
        self._client_factory, self._rows = client_factory, rows
        self._opts = {"loss_mask": "assistant", **(options or {})}
        self._record = Path(out_dir) / "mix_jobs.json"
        self._stop = threading.Event()
        self._pass = 0
        self._in_pass = 0
        self._it: Iterator[dict] | None = None
        self.mine: dict[str, int] = {}
        self.before: set[str] | None = None  # jobs there before the run: neither traffic nor ours
        self.traffic = 0
        if self._record.exists():  # a restarted run: its own jobs and what it found there
            rec = json.loads(self._record.read_text())
            self.mine, self.before = dict(rec.get("mine", {})), set(rec.get("before", []))

    def stop(self) -> None:
        self._stop.set()

    def _next_rows(self, n: int) -> list[dict]:
        out: list[dict] = []
        while len(out) < n:
            if self._it is None:
                self._it, self._in_pass = self._rows(self._pass), 0
                self._pass += 1
            row = next(self._it, None)
            if row is None:
                if self._in_pass == 0:
                    raise ValueError("the mix source holds no rows")
                self._it = None  # the next pass, shuffled with the next seed
                continue
            self._in_pass += 1
            out.append(row)
        return out

    def look(self, c: object) -> int:
        """One look at the sidecar: upload what keeps the share; the rows sent."""
        jobs = c.jobs()  # type: ignore[attr-defined]
        if self.before is None:
            self.before = {j.job_id for j in jobs}
        self.traffic = sum(sum(j.counts.values()) for j in jobs if j.job_id not in self.before and j.job_id not in self.mine)
        want = mix_target(self.traffic, self.share) - sum(self.mine.values())
        sent = 0
        while want - sent >= self.batch:
            rows = self._next_rows(self.batch)
            created = c.upload(rows, self._opts, filename="mix.jsonl")  # type: ignore[attr-defined]
            self.mine[created.job_id] = created.num_samples
            sent += len(rows)
        if sent:
            self._record.write_text(json.dumps({"mine": self.mine, "before": sorted(self.before)}) + "\n")
            log.info("mix: %d rows of the original data sent beside %d traffic samples (share %.2f)", sent,
                     self.traffic, self.share)  # fmt: skip
        return sent

    def run(self) -> None:
        from connector.contract.rest_client import SidecarError

        c = None
        while not self._stop.wait(self.every_s):
            try:
                c = c or self._client_factory()
                self.look(c)
            except SidecarError as e:
                log.warning("mix: the sidecar did not answer (%s): trying again", str(e)[:200])
            except Exception:  # noqa: BLE001 - the mixer never stops the training
                log.exception("mix: stopped")
                return
