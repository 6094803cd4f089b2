"""Where ``hsstream proxy autoswap`` keeps the drafts it gates and swaps in: copies of the
trainer's checkpoints, not the checkpoints themselves.

The trainer prunes its checkpoints as it goes (``--keep-checkpoints``, 2 by default) while a gate
may still be starting its engine on one (minutes, on a core it shares with the trainer: seen in
the live-traffic study, where the gate's engine found its checkpoint gone), and a draft swapped in
must stay where the serving engine and a rollback load it from. So each candidate is copied into
``RUN/swap-candidates/VERSION`` before it is gated; a refused or failed one is deleted at once; of
those swapped in, the newest ``keep`` stay (the live one and the one a rollback goes back to).
What an earlier autoswap left there counts as swapped in, newest first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

DIR = "swap-candidates"


class Candidates:
    def __init__(self, run: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep at least the live draft")
        self.root, self.keep = Path(run) / DIR, keep
        self.root.mkdir(parents=True, exist_ok=True)
        for tmp in self.root.glob(".*.partial"):  # a copy cut off by a kill
            shutil.rmtree(tmp, ignore_errors=True)
        self.swapped = sorted((d for d in self.root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
        self._prune()

    def take(self, draft: str | Path, version: str) -> Path:
        """A copy of ``draft`` as ``VERSION`` (written under a temporary name, then renamed: a
        copy is whole or absent). OSError if the draft went away meanwhile."""
        if not version or "/" in version or version.startswith("."):
            raise ValueError(f"not a version name for a directory: {version!r}")
        dest, tmp = self.root / version, self.root / f".{version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(draft, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if dest.exists():  # the same version again (a restarted run): the newer copy wins
            shutil.rmtree(dest)
            self.swapped = [d for d in self.swapped if d != dest]
        tmp.rename(dest)
        return dest

    def drop(self, copy: Path) -> None:
        """A copy that was not swapped in (refused, or its swap failed)."""
        if copy not in self.swapped:
            shutil.rmtree(copy, ignore_errors=True)

    def swapped_in(self, copy: Path) -> None:
        self.swapped = [d for d in self.swapped if d != copy] + [copy]
        self._prune()

    def _prune(self) -> None:
        while len(self.swapped) > self.keep:
            shutil.rmtree(self.swapped.pop(0), ignore_errors=True)
