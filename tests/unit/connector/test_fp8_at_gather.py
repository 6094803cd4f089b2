"""FP8 encoded where the rows are (the gatherer, on the GPU before the copy) gives the bytes of
FP8 encoded by the writer thread (the host path), chunk by chunk as the gatherer copies."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from connector import protocol as P  # noqa: E402
from connector.cache_layout import block_chunks, gather_rows  # noqa: E402
from connector.contract import payload as PL  # noqa: E402
from connector.layers import storage_permutation  # noqa: E402
from connector.spool_writer import ShapeInfo, SpoolWriter  # noqa: E402
from connector.step_metadata import PendingSave  # noqa: E402
from connector.worker_side import HiddenStateGatherer  # noqa: E402

from tests.support import sample_files  # noqa: E402

BS, H = 4, 16
LAYERS = [5, 2, 10]  # perm [1, 0, 2]: storage order differs from the file's
K = len(LAYERS)
N = 23  # 6 blocks, the last one partly used
BLOCKS = [9, 2, 14, 5, 0, 11, 3]  # non-contiguous, one spare
TAG = P.RequestTag(key=P.SampleKey(job="j", index=0), attempt=0)  # write_sample's own
FP8_SHAPE = ShapeInfo(layer_ids=LAYERS, num_hidden_layers=12, hidden_size=H, dtype=PL.FP8_DTYPE, model="m")


def _cache(dtype: torch.dtype, layout: str = "old", num_blocks: int = 16):
    """(cache as vLLM hands it, physical [blocks, BS, K, H]) holding tokens the quantisation
    finds hard: all zeros, signed zeros, the dtype's largest and smallest values, subnormals,
    an outlier token, one huge value among small ones."""
    g = torch.Generator().manual_seed(3)
    phys = torch.randn((num_blocks, BS, K, H), generator=g)
    fi = torch.finfo(dtype)
    rows = phys.view(-1, K, H)

    def tok(t: int) -> torch.Tensor:  # the storage row of the request's token t
        return rows[BLOCKS[t // BS] * BS + t % BS]

    tok(0).zero_()
    tok(1)[0].fill_(-0.0)
    tok(2)[1, 3] = fi.max
    tok(2)[2, 0] = -fi.max
    tok(5).fill_(fi.tiny)  # smallest normal: its scale is the 1e-12 floor
    tok(6).fill_(fi.tiny / 4)  # subnormal
    tok(6)[0, 0] = -fi.tiny / 8
    tok(9).mul_(300.0)  # an outlier token (an attention sink)
    tok(13)[1, 7] = 1e4  # a huge value among small ones: the rest go to e4m3's subnormals and 0
    tok(N - 1).fill_(-1.5)  # the last token, in the partly used block
    phys = phys.to(dtype)
    return (phys if layout == "old" else phys.permute(0, 2, 1, 3)), phys


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (bitwise comparison: -0.0 and NaN included)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(_raw(a[k]), _raw(b[k])) for k in a)  # fmt: skip


def _file(path) -> tuple[dict, bytes]:
    """A safetensors file as (its header, parsed: the order of its metadata keys varies from
    one save to the next; the bytes after it: every tensor's, in the file's order)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rows(kv, perm) -> torch.Tensor:
    """The request's rows in the file's layer order, gathered at once (today's CPU gather)."""
    g = HiddenStateGatherer(kv, BS, K, perm, _writer(None), encode_at_gather=False)
    return gather_rows(g.view, torch.tensor(BLOCKS), N, g.perm)


def _host_path(kv, perm) -> dict[str, torch.Tensor]:
    """What the writer thread encodes today: the whole request's rows, then encode."""
    return PL.codec(PL.FP8_DTYPE).encode(_rows(kv, perm))


def _writer(spool) -> SpoolWriter:
    return SpoolWriter(spool or "/nonexistent", None, FP8_SHAPE, num_threads=1)


class _PerChunkScale(PL.Fp8E4m3):
    """A wrong codec: one scale for a whole chunk (not per token). The control: the checks
    below must tell its bytes from the host path's."""

    def encode(self, hs):
        amax = hs.abs().amax().float().expand(hs.shape[0], 1, 1).clone()
        scale = (amax / PL.FP8_MAX).clamp(min=PL.MIN_SCALE)
        return {P.HIDDEN_STATES_KEY: (hs / scale).to(torch.float8_e4m3fn), PL.SCALES_KEY: scale}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["old", "new"])
@pytest.mark.parametrize("chunk_tokens", [4, 9, 8192])  # 1 block a chunk, 2 (a chunk ends mid-request), all
def test_chunked_encode_at_gather_gives_the_host_paths_bytes(dtype, layout, chunk_tokens):
    kv, _ = _cache(dtype, layout)
    perm = storage_permutation(LAYERS)
    want = _host_path(kv, perm)
    g = HiddenStateGatherer(kv, BS, K, perm, _writer(None), chunk_tokens=chunk_tokens, encode_at_gather=True)
    assert g.encode_at_gather and not g.cuda
    out = g.empty_host(N, pin_memory=False)
    g.gather_into(BLOCKS, N, out)  # the loop the CUDA path runs on its side stream
    assert len(list(block_chunks(BLOCKS, N, BS, chunk_tokens))) == {4: 6, 9: 3, 8192: 1}[chunk_tokens]
    assert _same_bytes(out, want)
    assert float(out[PL.SCALES_KEY][0]) == pytest.approx(PL.MIN_SCALE)  # the all-zero token
    assert int((_raw(out[P.HIDDEN_STATES_KEY][1]) == 0x80).sum()) == H  # its layer of -0.0 stays -0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_check_tells_a_per_chunk_scale_from_a_per_token_one(dtype):
    kv, _ = _cache(dtype)
    perm = storage_permutation(LAYERS)
    want = _host_path(kv, perm)
    g = HiddenStateGatherer(kv, BS, K, perm, _writer(None), chunk_tokens=4, encode_at_gather=True)
    g.codec = _PerChunkScale()
    out = g.empty_host(N, pin_memory=False)
    g.gather_into(BLOCKS, N, out)
    assert not _same_bytes(out, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantisation_is_hs_connectors_own_on_hard_values(dtype):
    """quantize_fp8 skips hs-connectors' float32 copy of the rows (less device scratch): still
    their bytes, on the values where rounding and the scale floor matter."""
    fp8_utils = pytest.importorskip("hs_connectors.fp8_utils")
    _, phys = _cache(dtype)
    x = phys.reshape(-1, K, H)
    q, s = PL.quantize_fp8(x)
    q2, s2 = fp8_utils.quantize_tensor_to_fp8(x)
    assert torch.equal(_raw(q), _raw(q2)) and torch.equal(_raw(s), _raw(s2))


def test_where_the_codec_encodes():
    """On CPU the writer thread encodes (no device-to-host bytes to save; encoding in the
    gatherer would run on the engine's step); a codec that is not per token never encodes at gather."""
    kv, _ = _cache(torch.bfloat16)
    fp8 = HiddenStateGatherer(kv, BS, K, None, _writer(None))
    assert not fp8.encode_at_gather and fp8.nbytes_for(N) == N * K * H * 2
    asked = HiddenStateGatherer(kv, BS, K, None, _writer(None), encode_at_gather=True)
    assert asked.encode_at_gather and asked.nbytes_for(N) == N * (K * H + 4)  # half, plus the scales
    bf16 = ShapeInfo(layer_ids=LAYERS, num_hidden_layers=12, hidden_size=H, dtype="bfloat16", model="m")
    plain = HiddenStateGatherer(kv, BS, K, None, SpoolWriter("/nonexistent", None, bf16), encode_at_gather=True)
    assert not plain.encode_at_gather


def _gather_and_write(spool, kv, perm, *, encode_at_gather: bool | None, chunk_tokens: int = 9):
    writer = SpoolWriter(spool, None, FP8_SHAPE, num_threads=1)
    jobs, sent = [], []
    real_submit = writer.submit
    writer.submit = lambda job: (jobs.append((job.hidden_states, job.encoded)), real_submit(job))[1]
    writer._publish = sent.append  # the notice the writer would send
    g = HiddenStateGatherer(kv, BS, K, perm, writer, chunk_tokens=chunk_tokens, encode_at_gather=encode_at_gather)
    g.submit(PendingSave("cmpl-8", "hs-8.safetensors", list(range(100, 100 + N)), BLOCKS, TAG.model_dump(mode="json")))
    assert writer.flush(10)  # the writer waited for the copy (on CUDA): poll now sees it landed
    assert g.poll({"cmpl-8"}) == {"cmpl-8"}
    writer.close()
    (notice,) = sent
    assert notice.status is P.NoticeStatus.ok, notice.reason
    return spool / "hs-8.safetensors", notice, jobs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_file_written_from_the_gatherers_encoding_is_todays_file(tmp_path, dtype):
    """Gatherer + writer with the encoding done at gather, chunked: the same file (tensors'
    bytes, checksum, header) as the writer thread's encoding of the same rows."""
    kv, _ = _cache(dtype, "new")
    perm = storage_permutation(LAYERS)
    for d in "abc":
        (tmp_path / d).mkdir()
    ours, n_ours, jobs = _gather_and_write(tmp_path / "a", kv, perm, encode_at_gather=True)
    today, n_today, jobs_today = _gather_and_write(tmp_path / "b", kv, perm, encode_at_gather=False)
    (hs, encoded), ((hs_today, encoded_today),) = jobs[0], jobs_today
    assert hs is None and set(encoded) == {P.HIDDEN_STATES_KEY, PL.SCALES_KEY}  # the writer did not encode
    assert hs_today is not None and encoded_today is None
    # ... and today's path is the one the tests' sample files come from
    ref = sample_files.write_sample(tmp_path / "c", "hs-8.safetensors", layer_ids=LAYERS, num_hidden_layers=12,
                                    dtype=PL.FP8_DTYPE, hidden_states=_rows(kv, perm), token_ids=list(range(100, 100 + N)),
                                    request_id="cmpl-8", model="m")  # fmt: skip
    assert n_ours.checksum == n_today.checksum == ref.notice.checksum
    assert n_ours.nbytes == n_today.nbytes == N * (K * H + 4)
    assert _same_bytes(load_file(ours), load_file(today))
    assert _file(ours) == _file(today) == _file(ref.path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host: see docs/benchmarks.md)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_fp8_is_encoded_on_the_side_stream_with_the_host_paths_bytes(tmp_path, dtype):
    """The real copy_async: quantised on the GPU, per chunk, copied as fp8 + scales into
    pinned memory (half the bytes), written; the file is the host path's, byte for byte."""
    kv_cpu, _ = _cache(dtype, "new")
    perm = storage_permutation(LAYERS)
    kv = kv_cpu.cuda()
    for d in ("gpu", "cpu", "d2h"):
        (tmp_path / d).mkdir()
    gpu, n_gpu, jobs = _gather_and_write(tmp_path / "gpu", kv, perm, encode_at_gather=None)
    ((hs, encoded),) = jobs
    assert hs is None and encoded[P.HIDDEN_STATES_KEY].dtype == torch.float8_e4m3fn
    assert all(t.is_pinned() and not t.is_cuda for t in encoded.values())
    cpu, n_cpu, _ = _gather_and_write(tmp_path / "cpu", kv_cpu, perm, encode_at_gather=False)
    d2h, n_d2h, _ = _gather_and_write(tmp_path / "d2h", kv, perm, encode_at_gather=False)  # bf16 copied, host encodes
    assert n_gpu.checksum == n_cpu.checksum == n_d2h.checksum
    # the file's hidden states and scales against the codec's own encoding (which has no token ids)
    assert _same_bytes({k: v for k, v in load_file(gpu).items() if k != P.TOKEN_IDS_KEY}, _host_path(kv_cpu, perm))
    assert _file(gpu) == _file(cpu) == _file(d2h)


def test_fp8_is_quantised_on_the_device_by_default_and_on_the_writer_thread_when_turned_off(tmp_path, monkeypatch):
    """HSSTREAM_FP8_ON_DEVICE (default on): the gatherer encodes where the cache is on CUDA
    (None: CUDA only), never on a CPU cache; off: always the writer thread."""
    plugin = pytest.importorskip("connector.vllm_plugin")
    from tests.integration.connector.test_connector_startup import vllm_config

    extra = {"shared_storage_path": str(tmp_path), "payload_dtype": "fp8_e4m3"}
    monkeypatch.delenv("HSSTREAM_FP8_ON_DEVICE", raising=False)
    assert plugin.ConnectorOptions.from_vllm(vllm_config([2], extra)).fp8_on_device
    assert not plugin.ConnectorOptions.from_vllm(vllm_config([2], {**extra, "fp8_on_device": "0"})).fp8_on_device
    monkeypatch.setenv("HSSTREAM_FP8_ON_DEVICE", "0")
    assert not plugin.ConnectorOptions.from_vllm(vllm_config([2], extra)).fp8_on_device
    kv, _ = _cache(torch.bfloat16, "new")
    assert not HiddenStateGatherer(kv, BS, K, None, _writer(None), encode_at_gather=None).encode_at_gather  # CPU cache
