"""Payload dtypes: how a sample's hidden states are stored in its file, one codec class each.

The connector writes (:meth:`PayloadCodec.encode`), the sidecar prices (bytes per token) and
the trainer reads, checks and decodes by these codecs; nothing else knows what a payload dtype
means. A codec is keyed by the *stored* dtype, the torch name a notice's ``dtype`` carries, so a
reader knows from the notice alone which tensors the file must hold. Adding a dtype is one
:class:`PayloadCodec` subclass plus one :func:`register` line. Importable without torch (the
sidecar prices samples without it); the methods that touch tensors import it lazily.

Two payload settings (``HSSTREAM_PAYLOAD_DTYPE`` / ``kv_connector_extra_config.payload_dtype``):

* ``model`` (the default): the verifier's own dtype (bf16, fp16 or fp32), unchanged;
  tensors ``hidden_states`` [T, K, H] and ``token_ids`` [T] int64 (:class:`ModelDtype`).
* ``fp8_e4m3``: hidden states quantised to ``float8_e4m3fn`` with one float32 scale per token,
  in the layout of speculators' hs-connectors 0.9 FP8 payload (``hs_connectors.fp8_utils`` and
  ``FP8HiddenStatesConnector``), so its readers (``FP8Transfer``) load our files unchanged
  (:class:`Fp8E4m3`):

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from connector.contract.sample_file import HIDDEN_STATES_KEY, TOKEN_ID_DTYPES, TOKEN_IDS_KEY

if TYPE_CHECKING:
    import torch

#: The payload setting that stores the verifier's own dtype.
MODEL = "model"
FP8_E4M3 = "fp8_e4m3"

#: Stored dtype names (torch's, without ``torch.``), as notices carry them.
FP8_DTYPE = "float8_e4m3fn"
#: hs-connectors' ``fp8_utils.SCALES_KEY``: the per-token scales of an FP8 file.
SCALES_KEY = "hidden_states_scales"
SCALE_DTYPE = "float32"
#: The largest finite float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max).
FP8_MAX = 448.0
#: hs-connectors' floor of a scale (an all-zero token must not divide by zero).
MIN_SCALE = 1e-12


class PayloadError(ValueError):
    """A payload setting or file that does not follow this contract."""


class PayloadCodec:
    """One stored dtype of a sample file's hidden states: what it is called, what it costs,
    how it is written, checked and read back."""

    #: The stored dtype, torch's name (a notice's ``dtype``), and safetensors' name of it.
    dtype: ClassVar[str]
    safetensors_dtype: ClassVar[str]
    #: Bytes per stored value.
    itemsize: ClassVar[int]
    #: The ``HSSTREAM_PAYLOAD_DTYPE`` value that chooses this codec; None: chosen when it is the
    #: verifier's own dtype (``model``).
    setting: ClassVar[str | None] = None
    #: Bytes of extra tensors per token (FP8's scales).
    scale_bytes_per_token: ClassVar[int] = 0
    #: Tensors the file holds beside ``hidden_states`` and ``token_ids``, with their
    #: safetensors dtype names and bytes per value.
    extra_tensors: ClassVar[dict[str, tuple[str, int]]] = {}
    #: True when the stored values are not what a trainer computes with: the stream decodes
    #: them (``HiddenStateStream(dequantize=…)``) after its checks.
    encoded: ClassVar[bool] = False
    #: The finiteness test on raw bits: (numpy integer dtype of the same width, the exponent
    #: mask; a value whose masked bits equal the mask is an infinity or a NaN). None: test
    #: with ``torch.isfinite``.
    finite_bits: ClassVar[tuple[str, int] | None] = None
    #: True when the gatherer should encode on the GPU, before the device-to-host copy: the
    #: encoding shrinks the bytes that copy moves (FP8: half of bf16's), and it is per token
    #: (whole tokens encode to the same bytes alone as within the whole), so the gatherer may
    #: encode chunk by chunk. :meth:`encode` must then be tensor operations only, which run
    #: on whichever device and stream hold the rows. False: the writer thread encodes.
    encode_on_device: ClassVar[bool] = False

    def tensor_names(self) -> frozenset[str]:
        """The tensors a file of this dtype holds, no more, no fewer."""
        return frozenset({HIDDEN_STATES_KEY, TOKEN_IDS_KEY, *self.extra_tensors})

    def bytes_per_position(self, num_layers: int, hidden_size: int) -> int:
        """Payload bytes per token: the hidden states plus the extra tensors (not the token ids)."""
        return num_layers * hidden_size * self.itemsize + self.scale_bytes_per_token

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def encode(self, hs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The file's hidden-state tensors for ``hs`` [T, K, H] in the verifier's dtype."""
        return {HIDDEN_STATES_KEY: hs.to(self.torch_dtype())}

    def empty_encoded(self, num_tokens: int, num_layers: int, hidden_size: int, *,
                      pin_memory: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
        """Uninitialised tensors shaped as :meth:`encode`'s output for ``num_tokens`` tokens: the
        host buffers an encode done chunk by chunk on the device is copied into."""
        import torch

        shape = (num_tokens, num_layers, hidden_size)
        return {HIDDEN_STATES_KEY: torch.empty(shape, dtype=self.torch_dtype(), pin_memory=pin_memory)}

    def check(self, tensors: dict[str, torch.Tensor], num_tokens: int) -> None:
        """Check the extra tensors (shapes, dtypes, values); raises :class:`PayloadError`."""

    def decode(self, hs: torch.Tensor, extras: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The hidden states in ``dtype`` (for an ``encoded`` payload; else ``hs`` as it is)."""
        return hs.to(dtype) if self.encoded else hs


class ModelDtype(PayloadCodec):
    """A verifier's own dtype, stored unchanged (``payload_dtype`` ``model``)."""

    def encode(self, hs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {HIDDEN_STATES_KEY: hs}


class Bf16(ModelDtype):
    dtype, safetensors_dtype, itemsize, finite_bits = "bfloat16", "BF16", 2, ("int16", 0x7F80)


class Fp16(ModelDtype):
    dtype, safetensors_dtype, itemsize, finite_bits = "float16", "F16", 2, ("int16", 0x7C00)


class Fp32(ModelDtype):
    dtype, safetensors_dtype, itemsize, finite_bits = "float32", "F32", 4, ("int32", 0x7F800000)


class Fp8E4m3(PayloadCodec):
    """float8_e4m3fn with one float32 scale per token, hs-connectors' layout (module docstring)."""

    dtype = FP8_DTYPE
    safetensors_dtype = "F8_E4M3"
    itemsize = 1
    setting = FP8_E4M3
    scale_bytes_per_token = 4
    extra_tensors = {SCALES_KEY: ("F32", 4)}
    encoded = True
    finite_bits = ("uint8", 0x7F)  # e4m3fn has no infinity; NaN is S.1111.111
    encode_on_device = True  # one scale per token; quantize_fp8 is tensor operations only

    def encode(self, hs: torch.Tensor) -> dict[str, torch.Tensor]:
        fp8, scales = quantize_fp8(hs)
        return {HIDDEN_STATES_KEY: fp8, SCALES_KEY: scales}

    def empty_encoded(self, num_tokens: int, num_layers: int, hidden_size: int, *,
                      pin_memory: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
        import torch

        out = super().empty_encoded(num_tokens, num_layers, hidden_size, pin_memory=pin_memory)
        out[SCALES_KEY] = torch.empty((num_tokens, 1, 1), dtype=torch.float32, pin_memory=pin_memory)
        return out

    def check(self, tensors: dict[str, torch.Tensor], num_tokens: int) -> None:
        check_scales(tensors[SCALES_KEY], num_tokens)

    def decode(self, hs: torch.Tensor, extras: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(hs, extras[SCALES_KEY], dtype)


#: Every codec, by stored dtype. Register new ones with :func:`register`.
CODECS: dict[str, PayloadCodec] = {}
#: Bytes per stored value and extra bytes per token, by stored dtype (kept by :func:`register`).
ELEMENT_SIZES: dict[str, int] = {}
SCALE_BYTES_PER_TOKEN: dict[str, int] = {}


def register(codec: PayloadCodec) -> PayloadCodec:
    """Add ``codec`` (or replace the one of its stored dtype)."""
    CODECS[codec.dtype] = codec
    ELEMENT_SIZES[codec.dtype] = codec.itemsize
    if codec.scale_bytes_per_token:
        SCALE_BYTES_PER_TOKEN[codec.dtype] = codec.scale_bytes_per_token
    else:
        SCALE_BYTES_PER_TOKEN.pop(codec.dtype, None)
    return codec


register(Bf16())
register(Fp16())
register(Fp32())
register(Fp8E4m3())


def codec(dtype: str) -> PayloadCodec:
    """The codec of a stored dtype (a notice's ``dtype``), or :class:`PayloadError`."""
    try:
        return CODECS[dtype]
    except KeyError:
        raise PayloadError(f"unknown payload dtype {dtype!r} (known: {', '.join(CODECS)})") from None


def payload_dtypes() -> tuple[str, ...]:
    """The values ``HSSTREAM_PAYLOAD_DTYPE`` may take: ``model`` and each codec's setting."""
    return (MODEL, *(c.setting for c in CODECS.values() if c.setting))


def check_payload_dtype(name: str) -> str:
    """``name`` if it is a payload dtype we write, else a message listing the choices."""
    if name not in payload_dtypes():
        raise PayloadError(f"payload dtype {name!r} is not one of {list(payload_dtypes())} (HSSTREAM_PAYLOAD_DTYPE)")
    return name


def stored_dtype(payload_dtype: str, model_dtype: str) -> str:
    """The dtype a file holds for a verifier running in ``model_dtype``."""
    if check_payload_dtype(payload_dtype) == MODEL:
        return model_dtype
    return next(c.dtype for c in CODECS.values() if c.setting == payload_dtype)


def codec_for_setting(payload_dtype: str, model_dtype: str) -> PayloadCodec:
    """The codec the writer uses for ``HSSTREAM_PAYLOAD_DTYPE`` and the verifier's dtype."""
    return codec(stored_dtype(payload_dtype, model_dtype))


def is_quantized(dtype: str) -> bool:
    """True for a stored dtype that comes with extra tensors (FP8's scales)."""
    return dtype in CODECS and bool(CODECS[dtype].extra_tensors)


def bytes_per_position(num_layers: int, hidden_size: int, dtype: str) -> int:
    """Payload bytes per token: the hidden states plus their scales (token ids not included)."""
    return codec(dtype).bytes_per_position(num_layers, hidden_size)


def tensor_names(dtype: str) -> frozenset[str]:
    """The tensors a file of this stored dtype holds, no more, no fewer."""
    return codec(dtype).tensor_names()


def safetensors_itemsizes() -> dict[str, int]:
    """Every safetensors dtype name a sample file may hold, with its bytes per value: the
    codecs' hidden states and extra tensors, and the token ids' (the header parser's table)."""
    out = dict(TOKEN_ID_DTYPES)
    for c in CODECS.values():
        out[c.safetensors_dtype] = c.itemsize
        out.update(dict(c.extra_tensors.values()))
    return out


def safetensors_torch_dtype(name: str) -> torch.dtype:
    """torch's dtype for a safetensors dtype name (one :func:`safetensors_itemsizes` lists)."""
    import torch

    fixed = {"I64": torch.int64, "I32": torch.int32, "F32": torch.float32}
    if name in fixed:
        return fixed[name]
    for c in CODECS.values():
        if c.safetensors_dtype == name:
            return c.torch_dtype()
    raise PayloadError(f"no codec stores safetensors dtype {name!r}")


def checksum_buffers(tensors: dict[str, Any]) -> list[Any]:
    """The byte buffers the checksum covers, in its order (``sample_file.checksum_buffers``)."""
    from connector.contract.sample_file import checksum_buffers as _buffers

    return _buffers(tensors)


# -- FP8's tensors (torch imported lazily) -------------------------------------------------------


def quantize_fp8(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [T, K, H], float32 scales [T, 1, 1]) of ``hs`` [T, K, H], as hs-connectors'
    ``quantize_tensor_to_fp8`` computes them (so both writers give the same bytes).

    Tensor operations only: the gatherer runs it on the GPU, on its side stream, chunk by
    chunk (``PayloadCodec.encode_on_device``), and the writer thread on the host. Their
    ``hs.float()`` copy is left out: ``abs`` and ``amax`` are exact in bf16 and fp16, and
    dividing by the float32 scale promotes ``hs`` to float32 value by value, so the bytes are
    theirs while the device holds 4 bytes per value less scratch."""
    import torch

    amax = hs.abs().amax(dim=tuple(range(1, hs.dim())), keepdim=True).float()
    # Divided by a tensor, not the Python number: CUDA divides a tensor by a CPU scalar as a
    # multiplication by its reciprocal (1/448 is inexact), which the host does not, so the
    # scales (and every byte after them) differed by an ulp between the two paths on the H200.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    return (hs / scale).to(torch.float8_e4m3fn), scale


def dequantize(fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8 * scale`` in ``dtype`` (hs-connectors' ``dequantize_fp8_tensor``)."""
    return fp8.to(dtype) * scales.to(dtype)


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
