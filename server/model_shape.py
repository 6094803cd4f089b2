"""What a sample costs on the spool, known before it is submitted.

The spool budget reserves a sample's file bytes before vLLM sees it, which needs the
shape of its hidden states: layers × hidden size × dtype size per position. That comes
from the verifier's config when the sidecar can read one, with the layer ids vLLM gets
(``HSSTREAM_LAYER_IDS``, else the launcher's default, never "one layer"). When the config
cannot be read (a hub id, a folder without config.json), the first notice tells: it
carries the layer ids, hidden size and dtype the connector really wrote. Until the shape is
known the submitter sends one sample at a time (:class:`server.submitter.Submitter`), so
an unknown size can never overrun the spool by more than one sample.

A notice is the truth: if it disagrees with the config (vLLM ran another dtype than the
config names, say), its shape replaces the estimate and queued samples are priced again. An error
notice counts too (the writer's shape rides on every notice): with the arena, a slot priced too
small is refused before a byte is written, and that refusal is the notice that corrects it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass

from connector.contract import payload as PL
from connector import protocol as P
from connector.layers import default_layer_ids

log = logging.getLogger("hsstream.sidecar")


def too_long_reason(num_tokens: int, limit: int, room: int, what: str) -> str:
    """Why a sample is refused: it names the limit as the user set it (``--max-model-len``)."""
    return (f"sample has {num_tokens} tokens, more than {what} of {limit} allows "
            f"({limit - room} prompt tokens + {room} generated)")  # fmt: skip


def over_budget_reason(nbytes: int, budget: int) -> str:
    return (f"sample needs {nbytes:,} spool bytes, more than the whole spool budget of {budget:,} "
            "(HSSTREAM_SPOOL_BUDGET_BYTES)")  # fmt: skip


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    dtype_size: int
    source: str  # where it was learned, for logs and /v1/stats
    scale_bytes: int = 0  # per position: a quantised payload's scales (connector/contract/payload.py)

    def file_bytes(self, positions: int) -> int:
        return P.expected_file_bytes(positions, self.num_layers, self.hidden_size, self.dtype_size, self.scale_bytes)

    def same_size(self, other: Shape) -> bool:
        return (self.num_layers, self.hidden_size, self.dtype_size, self.scale_bytes) == (
            other.num_layers, other.hidden_size, other.dtype_size, other.scale_bytes)  # fmt: skip


def read_config(model: str | None) -> dict | None:
    """The verifier's (text) config, or None when there is no readable local config.json."""
    if not model:
        return None
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("cannot read the verifier's config %s (%s): sample sizes will be learned from the first "
                    "notice, one sample at a time until then", path, e)  # fmt: skip
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


def _shape(num_layers: int, hidden_size: int, dtype: str, source: str) -> Shape:
    return Shape(num_layers, hidden_size, P.DTYPE_SIZES.get(dtype, 2), source, PL.SCALE_BYTES_PER_TOKEN.get(dtype, 0))


def shape_from_config(cfg: dict | None, layer_ids: list[int], payload_dtype: str = PL.MODEL) -> Shape | None:
    """The shape from the verifier's config; ``payload_dtype`` (HSSTREAM_PAYLOAD_DTYPE) says how
    the connector stores it, so an FP8 payload is priced at its own bytes from the start."""
    if not cfg or not cfg.get("hidden_size"):
        return None
    ids = list(layer_ids)
    if not ids:
        n = cfg.get("num_hidden_layers")
        if not n:
            return None
        ids = default_layer_ids(int(n))
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    src = "config" + ("" if layer_ids else " (layer ids: the launcher's default)")
    return _shape(len(ids), int(cfg["hidden_size"]), PL.stored_dtype(payload_dtype, dt), src)


def shape_from_notice(n: P.Notice) -> Shape | None:
    """The writer's shape, which every notice it sends carries, an error's too: with the arena a
    sample priced by a config that names another dtype than vLLM runs (bf16 in the config, float32
    served on a CPU without bf16) is refused before it is written ("slot too small"), so the
    refusal is the only notice that can correct the price (else every sample failed there)."""
    if not n.layer_ids or not n.hidden_size or n.dtype not in P.DTYPE_SIZES:
        return None
    return _shape(len(n.layer_ids), n.hidden_size, n.dtype, "notice")


class SampleSizer:
    """The current shape; read by the event loop, learned on the notice thread."""

    def __init__(self, shape: Shape | None) -> None:
        self._lock = threading.Lock()
        self.shape = shape
        self.version = 0  # bumped whenever the shape changes: queued samples need new prices
        self._from_notice = False

    @classmethod
    def for_model(cls, model: str | None, layer_ids: list[int],
                  payload_dtype: str = PL.MODEL) -> tuple[SampleSizer, int | None]:  # fmt: skip
        """(sizer, the config's max_position_embeddings or None). An unknown ``payload_dtype``
        raises ``PayloadError`` naming the choices: the sidecar does not start on it."""
        PL.check_payload_dtype(payload_dtype)
        cfg = read_config(model)
        sizer = cls(shape_from_config(cfg, layer_ids, payload_dtype))
        mpe = cfg.get("max_position_embeddings") if cfg else None
        return sizer, int(mpe) if mpe else None

    @property
    def known(self) -> bool:
        return self.shape is not None

    def file_bytes(self, positions: int) -> int | None:
        shape = self.shape
        return None if shape is None else shape.file_bytes(positions)

    def learn(self, n: P.Notice) -> bool:
        """Take the shape from the first usable notice; True if the shape changed."""
        if self._from_notice:
            return False
        got = shape_from_notice(n)
        if got is None:
            return False
        with self._lock:
            if self._from_notice:
                return False
            self._from_notice = True
            old, self.shape = self.shape, got
            if old is not None and old.same_size(got):
                return False
            self.version += 1
        if old is None:
            log.info("sample size learned from the first notice: %d layers x %d x %d bytes per position",
                     got.num_layers, got.hidden_size, got.dtype_size)  # fmt: skip
        else:
            log.warning("the connector writes %d layers x %d x %d bytes per position, the config said %d x %d x %d: "
                        "budgeting by the notice from now on", got.num_layers, got.hidden_size, got.dtype_size,
                        old.num_layers, old.hidden_size, old.dtype_size)  # fmt: skip
        return True

    def describe(self) -> dict:
        s = self.shape
        if s is None:
            return {"known": False, "source": None}
        per_position = s.num_layers * s.hidden_size * s.dtype_size + s.scale_bytes
        return {"known": True, "source": s.source, "num_layers": s.num_layers, "hidden_size": s.hidden_size,
                "dtype_size": s.dtype_size, "scale_bytes": s.scale_bytes, "bytes_per_position": per_position}  # fmt: skip
