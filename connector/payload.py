"""Payload dtypes: how a sample's hidden states are stored in its file, in one place.

The connector writes, the sidecar prices (spool budget) and the trainer reads and checks by
these definitions; nothing else knows what a payload dtype means. Importable without torch
(the sidecar prices samples without it); the functions that touch tensors import it lazily.

Two payloads:

* ``model`` (the default): the verifier's own dtype (bf16, fp16 or fp32), unchanged;
  tensors ``hidden_states`` [T, K, H] and ``token_ids`` [T] int64.
* ``fp8_e4m3``: hidden states quantised to ``float8_e4m3fn`` with one float32 scale per token,
  in the layout of speculators' hs-connectors 0.9 FP8 payload (``hs_connectors.fp8_utils`` and
  ``FP8HiddenStatesConnector``), so its readers (``FP8Transfer``) load our files unchanged:

  ======================== ================= ====================
  tensor                   dtype             shape
  ======================== ================= ====================
  ``hidden_states``        ``F8_E4M3``       [T, K, H]
  ``hidden_states_scales`` ``F32``           [T, 1, 1]
  ``token_ids``            ``I64``           [T]
  ======================== ================= ====================

  ``scale = max(amax over the token's K×H values / 448, 1e-12)``, ``fp8 = x / scale`` (448:
  the largest finite e4m3fn); dequantised, ``x ≈ fp8.to(dtype) * scale.to(dtype)``. Per token,
  not per tensor: one outlier token (an attention sink's huge activations) then costs
  precision only for itself. 1 byte per value + 4 bytes per token: 0.5× bf16 plus the scales.

The notice's ``dtype`` names the stored dtype (``float8_e4m3fn`` for FP8), so a reader knows
from the notice alone which tensors the file must hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Values of ``HSSTREAM_PAYLOAD_DTYPE`` / ``kv_connector_extra_config.payload_dtype``.
MODEL = "model"
FP8_E4M3 = "fp8_e4m3"
PAYLOAD_DTYPES = (MODEL, FP8_E4M3)

#: Stored dtype names (torch's, without ``torch.``), as notices carry them.
FP8_DTYPE = "float8_e4m3fn"
#: Bytes per stored value.
ELEMENT_SIZES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, FP8_DTYPE: 1}
#: hs-connectors' ``fp8_utils.SCALES_KEY``: the per-token scales of an FP8 file.
SCALES_KEY = "hidden_states_scales"
SCALE_DTYPE = "float32"
#: Bytes of scales per token, by stored dtype (only quantised payloads have any).
SCALE_BYTES_PER_TOKEN: dict[str, int] = {FP8_DTYPE: 4}
#: The largest finite float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max).
FP8_MAX = 448.0
#: hs-connectors' floor of a scale (an all-zero token must not divide by zero).
MIN_SCALE = 1e-12


class PayloadError(ValueError):
    """A payload setting or file that does not follow this contract."""


def check_payload_dtype(name: str) -> str:
    """``name`` if it is a payload dtype we write, else a message listing the choices."""
    if name not in PAYLOAD_DTYPES:
        raise PayloadError(f"payload dtype {name!r} is not one of {list(PAYLOAD_DTYPES)} (HSSTREAM_PAYLOAD_DTYPE)")
    return name


def stored_dtype(payload_dtype: str, model_dtype: str) -> str:
    """The dtype a file holds for a verifier running in ``model_dtype``."""
    return FP8_DTYPE if check_payload_dtype(payload_dtype) == FP8_E4M3 else model_dtype


def is_quantized(dtype: str) -> bool:
    """True for a stored dtype that comes with scales (a notice's ``dtype``)."""
    return dtype in SCALE_BYTES_PER_TOKEN


def bytes_per_position(num_layers: int, hidden_size: int, dtype: str) -> int:
    """Payload bytes per token: the hidden states plus their scales (token ids not included)."""
    return num_layers * hidden_size * ELEMENT_SIZES[dtype] + SCALE_BYTES_PER_TOKEN.get(dtype, 0)


def tensor_names(dtype: str) -> frozenset[str]:
    """The tensors a file of this stored dtype holds, no more, no fewer."""
    from connector.protocol import HIDDEN_STATES_KEY, TOKEN_IDS_KEY

    names = {HIDDEN_STATES_KEY, TOKEN_IDS_KEY}
    if is_quantized(dtype):
        names.add(SCALES_KEY)
    return frozenset(names)


# -- tensors (torch imported lazily) -------------------------------------------------------------


def quantize_fp8(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [T, K, H], float32 scales [T, 1, 1]) of ``hs`` [T, K, H], as hs-connectors'
    ``quantize_tensor_to_fp8`` computes them (so both writers give the same bytes)."""
    import torch

    x = hs.float()
    amax = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return (x / scale).to(torch.float8_e4m3fn), scale


def dequantize(fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8 * scale`` in ``dtype`` (hs-connectors' ``dequantize_fp8_tensor``)."""
    return fp8.to(dtype) * scales.to(dtype)


def checksum_buffers(tensors: dict[str, Any]) -> list[Any]:
    """The byte buffers the checksum covers, in its order: hidden states, scales (if any), token
    ids. One definition for the writer and every reader."""
    import torch

    from connector.protocol import HIDDEN_STATES_KEY, TOKEN_IDS_KEY

    out = [tensors[HIDDEN_STATES_KEY].contiguous().view(torch.uint8).numpy()]
    if SCALES_KEY in tensors:
        out.append(tensors[SCALES_KEY].contiguous().view(torch.uint8).numpy())
    out.append(tensors[TOKEN_IDS_KEY].contiguous().numpy())
    return out


def check_scales(scales: torch.Tensor, num_tokens: int) -> None:
    """Scales as hs-connectors writes them: float32 [T, 1, 1], finite, positive (a zero or NaN
    scale would silently turn a token's states into zeros or NaNs when dequantised)."""
    import torch

    if scales.dtype != torch.float32:
        raise PayloadError(f"{SCALES_KEY} dtype {str(scales.dtype).removeprefix('torch.')}, expected {SCALE_DTYPE}")
    if tuple(scales.shape) != (num_tokens, 1, 1):
        raise PayloadError(f"{SCALES_KEY} shape {tuple(scales.shape)} != {(num_tokens, 1, 1)}")
    if num_tokens and not bool(torch.isfinite(scales).all()):
        raise PayloadError(f"{SCALES_KEY}: non-finite scale")
    if num_tokens and not bool((scales > 0).all()):
        raise PayloadError(f"{SCALES_KEY}: scale <= 0")
