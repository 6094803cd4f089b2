"""FP8 payloads (connector/contract/payload.py): hs-connectors' layout on file, validated by the reader,
dequantised by the stream, priced at their own bytes by the sidecar."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from connector.contract import payload as PL  # noqa: E402
from connector import protocol as P  # noqa: E402
from server.model_shape import SampleSizer, shape_from_config, shape_from_notice  # noqa: E402
from trainer_client import InvalidSample, read_hidden_states  # noqa: E402

from tests.support import sample_files  # noqa: E402

T, K, H = 9, 4, 64
IDS = list(range(100, 100 + T))


def _hs(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, K, H), generator=g)
    x[3] *= 200.0  # an outlier token: per-token scales keep the others precise
    return x.to(torch.bfloat16)


def _write(spool, dtype: str, hs: torch.Tensor, name: str = "hs-a.safetensors"):
    return sample_files.write_sample(spool, name, layer_ids=[1, 2, 3, 4], num_hidden_layers=4, dtype=dtype,
                                     hidden_states=hs, token_ids=IDS, request_id="cmpl-1").path  # fmt: skip


def test_quantisation_is_hs_connectors_own():
    hs_mod = pytest.importorskip("hs_connectors.fp8_utils")
    x = _hs()
    q, s = PL.quantize_fp8(x)
    q2, s2 = hs_mod.quantize_tensor_to_fp8(x)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert PL.SCALES_KEY == hs_mod.SCALES_KEY
    assert PL.FP8_MAX == torch.finfo(torch.float8_e4m3fn).max


def test_fp8_file_has_hs_connectors_layout_and_their_reader_takes_it(spool):
    transfer = pytest.importorskip("hs_connectors.transfer")
    x = _hs()
    path = _write(spool, PL.FP8_DTYPE, x)
    with safe_open(str(path), "pt") as f:
        got = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert got == {"hidden_states": ("F8_E4M3", [T, K, H]), "hidden_states_scales": ("F32", [T, 1, 1]),
                   "token_ids": ("I64", [T])}  # fmt: skip
    theirs = transfer.FP8Transfer(spool).get_generated({"hidden_states_path": str(path)})
    ours = read_hidden_states(path, IDS)
    assert set(theirs) == {"hidden_states", "token_ids"} and theirs["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(theirs["hidden_states"], ours.hidden_states) and theirs["token_ids"].tolist() == IDS


def test_reader_dequantises_on_request_and_keeps_fp8_otherwise(spool):
    x = _hs()
    path = _write(spool, PL.FP8_DTYPE, x)
    s = read_hidden_states(path, IDS)  # default: bf16
    assert s.hidden_states.dtype == torch.bfloat16 and s.scales is None and s.notice.dtype == PL.FP8_DTYPE
    # e4m3 has 3 mantissa bits: relative error per value <= 2^-4 of the token's amax, plus bf16 rounding
    err = (s.hidden_states.float() - x.float()).abs()
    amax = x.float().abs().amax(dim=(1, 2), keepdim=True)
    assert bool((err <= amax * 0.07).all())
    assert float(err[3].max()) > 1.0 > float(err[0].max())  # the outlier token costs only itself
    f32 = read_hidden_states(path, IDS, dequantize=torch.float32)
    assert f32.hidden_states.dtype == torch.float32
    raw = read_hidden_states(path, IDS, dequantize=None)
    assert raw.hidden_states.dtype == torch.float8_e4m3fn and tuple(raw.scales.shape) == (T, 1, 1)
    assert torch.equal(raw.dequantized(torch.float32).hidden_states, f32.hidden_states)


def test_unquantised_payload_is_unchanged(spool):
    x = _hs()
    path = _write(spool, "bfloat16", x)
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == {"hidden_states", "token_ids"}
    s = read_hidden_states(path, IDS)
    assert torch.equal(s.hidden_states, x) and s.scales is None


def _forge(spool, tensors: dict, dtype: str = PL.FP8_DTYPE):
    """A file as a buggy writer could make it: the checksum matches what is written, so only the
    payload checks can catch it."""
    hs = tensors[P.HIDDEN_STATES_KEY]
    n = P.Notice(status="ok", request_id="x", file="hs-f.safetensors", num_tokens=T, layer_ids=[1, 2, 3, 4],
                 num_hidden_layers=4, hidden_size=H, dtype=dtype, nbytes=hs.numel(),
                 checksum=P.checksum(*PL.checksum_buffers(tensors)))  # fmt: skip
    save_file(tensors, str(spool / "hs-f.safetensors"), metadata=P.header_metadata(n))
    return spool / "hs-f.safetensors"


def _good() -> dict:
    q, s = PL.quantize_fp8(_hs())
    return {"hidden_states": q, "hidden_states_scales": s, "token_ids": torch.tensor(IDS)}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_states_scales": None}, "unexpected tensors"),
        ({"hidden_states_scales": torch.ones(T, 1, 1, dtype=torch.bfloat16)}, "expected float32"),
        ({"hidden_states_scales": torch.ones(T, 1)}, "shape"),
        ({"hidden_states_scales": torch.ones(T, K, 1)}, "shape"),
        ({"hidden_states_scales": torch.tensor([1.0] * (T - 1) + [0.0]).view(T, 1, 1)}, "scale <= 0"),
        ({"hidden_states_scales": torch.tensor([1.0] * (T - 1) + [-2.0]).view(T, 1, 1)}, "scale <= 0"),
        ({"hidden_states_scales": torch.tensor([float("nan")] + [1.0] * (T - 1)).view(T, 1, 1)}, "non-finite scale"),
        ({"hidden_states_scales": torch.tensor([float("inf")] + [1.0] * (T - 1)).view(T, 1, 1)}, "non-finite scale"),
        ({"hidden_states": "nan"}, "non-finite hidden states"),
        ({"hidden_states": "bf16"}, "dtype"),
    ],
)
def test_reader_refuses_a_bad_fp8_file(spool, change, message):
    t = _good()
    for k, v in change.items():
        if v is None:
            del t[k]
        elif v == "nan":
            raw = t[k].view(torch.uint8).clone()
            raw[2, 1, 5] = 0x7F  # e4m3fn NaN
            t[k] = raw.view(torch.float8_e4m3fn)
        elif v == "bf16":
            t[k] = t[k].to(torch.bfloat16)
        else:
            t[k] = v
    path = _forge(spool, t)
    with pytest.raises(InvalidSample, match=message):
        read_hidden_states(path, IDS)


def test_a_good_forged_file_passes(spool):
    """The forge itself is sound: the failures above come from the payload checks."""
    assert read_hidden_states(_forge(spool, _good()), IDS).hidden_states.dtype == torch.bfloat16


def test_fp8_tensors_in_a_file_announced_as_bf16_are_refused(spool):
    t = _good()
    with pytest.raises(InvalidSample, match="unexpected tensors"):
        read_hidden_states(_forge(spool, t, dtype="bfloat16"), IDS)


def test_bytes_per_token_and_pricing(spool):
    """The sidecar prices an FP8 sample at its own bytes, from the config (the setting) or from
    the first notice, and never below what the file takes."""
    cfg = {"hidden_size": H, "num_hidden_layers": 4, "torch_dtype": "bfloat16"}
    bf16, fp8 = shape_from_config(cfg, [1, 2, 3, 4]), shape_from_config(cfg, [1, 2, 3, 4], PL.FP8_E4M3)
    assert PL.bytes_per_position(K, H, PL.FP8_DTYPE) == K * H + 4
    assert (bf16.dtype_size, bf16.scale_bytes, fp8.dtype_size, fp8.scale_bytes) == (2, 0, 1, 4)
    per_bf16 = PL.bytes_per_position(K, H, "bfloat16")
    assert PL.bytes_per_position(K, H, PL.FP8_DTYPE) / per_bf16 <= 0.55
    path = _write(spool, PL.FP8_DTYPE, _hs())
    size = path.stat().st_size
    assert fp8.file_bytes(T) >= size > fp8.file_bytes(T) - P.HEADER_ALLOWANCE - 8 * T
    n = read_hidden_states(path, IDS).notice
    assert n.nbytes == T * K * H + 4 * T  # hidden states and their scales
    learned = shape_from_notice(n)
    assert learned.same_size(fp8) and not learned.same_size(bf16)
    sizer = SampleSizer(bf16)
    assert sizer.learn(n) and sizer.version == 1 and sizer.file_bytes(T) == fp8.file_bytes(T)
    assert sizer.describe()["bytes_per_position"] == K * H + 4


def test_unknown_payload_dtype_is_refused_with_the_choices():
    with pytest.raises(PL.PayloadError, match=r"'fp4'.*\['model', 'fp8_e4m3'\].*HSSTREAM_PAYLOAD_DTYPE"):
        PL.stored_dtype("fp4", "bfloat16")
    with pytest.raises(PL.PayloadError):
        SampleSizer.for_model(None, [1], "fp16")  # the sidecar refuses to start on it
