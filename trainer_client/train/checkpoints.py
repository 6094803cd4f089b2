"""Checkpoints on disk, whatever the draft: the folders vLLM serves and the trainer resumes from.

A checkpoint is a folder ``step-NNNNNNNN/`` holding ``draft/`` (the draft's ``save_pretrained``
output: speculators' format, which vLLM loads as ``speculative_config={"method": <the draft's
method>, "model": ".../draft"}``) and ``trainer_state.pt``
(optimizer, schedule, step, and which samples the weights include). It is written under a
hidden temporary name and renamed into place, so a crash mid-write leaves no checkpoint that
looks complete; resume picks the newest complete one.

For serving, ``OUT/latest`` is a symlink to the newest checkpoint's ``draft/`` (moved with each
save) and ``OUT/final`` a copy of the last one's, written when training ends: both outside
``checkpoints/``, so rotating checkpoints (``keep``) never removes the draft users were told to
serve.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("hsstream.train")

CKPT_DIR = "checkpoints"
DRAFT_DIR = "draft"
LATEST_LINK = "latest"
FINAL_DIR = "final"
STATE_FILE = "trainer_state.pt"
_STEP_RE = re.compile(r"^step-(\d{8})$")


def verifier_text_config(verifier_dir: str) -> dict:
    c = json.loads((Path(verifier_dir) / "config.json").read_text())
    return c.get("text_config", c)


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / CKPT_DIR


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (a complete one has both the draft and the state)."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / STATE_FILE).is_file() and (p / DRAFT_DIR / "config.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    ck = list_checkpoints(out_dir)
    return ck[-1][1] if ck else None


def latest_draft(out_dir: str | Path) -> Path | None:
    """The folder to give vLLM as the draft ``model``."""
    ck = latest_checkpoint(out_dir)
    return ck / DRAFT_DIR if ck else None


def save_checkpoint(out_dir: str | Path, step: int, model, state: dict, keep: int = 2) -> Path:  # noqa: ANN001
    root = checkpoint_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step:08d}.tmp-", dir=root))
    try:
        model.save_pretrained(tmp / DRAFT_DIR)
        torch.save(state, tmp / STATE_FILE)
        for f in (tmp / STATE_FILE, *(tmp / DRAFT_DIR).iterdir()):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if final.exists():  # re-saving the same step (e.g. after a resume that only settled acks)
            old = root / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    point_latest(out_dir, final)
    for _, old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point_latest(out_dir: str | Path, ckpt: Path) -> Path:
    """``OUT/latest`` → ``checkpoints/step-N/draft`` (relative, so the run dir can move), replaced
    in one rename: a reader never finds it missing or pointing at a half-written checkpoint."""
    out = Path(out_dir)
    link = out / LATEST_LINK
    tmp = out / f".{LATEST_LINK}.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(ckpt / DRAFT_DIR, out), tmp)
    os.replace(tmp, link)
    return link


def publish_final(out_dir: str | Path, ckpt: Path) -> Path:
    """Copy ``ckpt``'s draft to ``OUT/final``, the folder ``vllm serve`` takes as the draft model.

    A copy, not a link: rotation or a later run in the same dir must not take it away. Written
    under a temporary name and renamed into place like a checkpoint."""
    out = Path(out_dir)
    dest = out / FINAL_DIR
    tmp = Path(tempfile.mkdtemp(prefix=f".{FINAL_DIR}.tmp-", dir=out))
    try:
        shutil.copytree(ckpt / DRAFT_DIR, tmp, dirs_exist_ok=True)
        (tmp / "checkpoint.json").write_text(json.dumps({"from": os.path.relpath(ckpt, out)}) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if dest.exists():
            old = out / f".{FINAL_DIR}.old-{os.getpid()}"
            os.rename(dest, old)
        os.rename(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def serve_command(verifier: str, draft_dir: str | Path, num_speculative_tokens: int | None = None, *,
                  spec: dict | None = None) -> str:  # fmt: skip
    """The shell line that serves the verifier with the draft, as ``bench/served_acceptance/acceptance.py`` does:
    ``spec`` is the draft's ``--speculative-config`` (``Draft.speculative_config``); without it an
    Eagle-3 one (``{"method": "eagle3", "model": <draft dir>, "num_speculative_tokens": N}``)."""
    if spec is None:
        spec = {"method": "eagle3", "model": str(Path(draft_dir).resolve()),
                "num_speculative_tokens": num_speculative_tokens}  # fmt: skip
    return f"vllm serve {shlex.quote(str(verifier))} --speculative-config {shlex.quote(json.dumps(spec))}"


def load_state(ckpt: Path) -> dict:
    """On the CPU whatever device wrote it (the optimizer moves its state to the parameters')."""
    return torch.load(ckpt / STATE_FILE, weights_only=True, map_location="cpu")
