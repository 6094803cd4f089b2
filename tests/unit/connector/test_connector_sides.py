"""The connector's two halves without vLLM: SchedulerSide decides, HiddenStateGatherer copies."""

from __future__ import annotations

import os
import pickle
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from connector import protocol as P  # noqa: E402
from connector.cache_layout import CacheLayoutError  # noqa: E402
from connector.layers import storage_permutation  # noqa: E402
from connector.scheduler_side import SchedulerSide  # noqa: E402
from connector.spool_writer import ShapeInfo, SpoolWriter  # noqa: E402
from connector.step_metadata import PendingSave  # noqa: E402
from connector.worker_side import HiddenStateGatherer  # noqa: E402

TAG = P.RequestTag(key=P.SampleKey(job="jobA", epoch=0, index=9), attempt=1)
SPOOL = "/dev/shm/hsstream-test"


def _request(rid="cmpl-7", prompt=(11, 12, 13, 14, 15), output=(), computed=None, params="tag"):
    prompt = list(prompt) if prompt is not None else None
    if params == "tag":
        params = P.kv_params_for(TAG)
    all_ids = (prompt or []) + list(output)
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        prompt_token_ids=prompt,
        all_token_ids=all_ids,
        num_computed_tokens=len(all_ids) if computed is None else computed,
    )


# ----------------------------------------------------------------------------- scheduler


def test_finished_request_is_saved():
    side = SchedulerSide(SPOOL)
    ok, params = side.request_finished(_request(output=(90,), computed=5), [4, 1, 7])
    assert ok is True
    assert params == {
        P.KV_PARAMS_PATH_KEY: f"{SPOOL}/hs-cmpl-7.safetensors",
        "hsstream_file": "hs-cmpl-7.safetensors",
    }
    (p,) = side.take_pending()
    assert p == PendingSave("cmpl-7", "hs-cmpl-7.safetensors", [11, 12, 13, 14, 15], [4, 1, 7], TAG.model_dump(mode="json"))
    assert p.error is None
    assert p.request_tag() == TAG
    assert side.take_pending() == []  # handed over once
    assert pickle.loads(pickle.dumps(p)) == p  # it travels in pickled step metadata


def test_include_output_tokens_drops_the_last_token():
    side = SchedulerSide(SPOOL)
    params = {**P.kv_params_for(TAG), "include_output_tokens": True}
    req = _request(prompt=(1, 2, 3), output=(10, 11, 12), computed=5, params=params)
    ok, out = side.request_finished(req, [0, 2])
    assert ok is True and out is not None
    (p,) = side.take_pending()
    assert p.token_ids == [1, 2, 3, 10, 11]  # 12 was sampled but never fed back
    assert p.error is None and p.request_tag() == TAG


def test_include_output_tokens_needs_the_outputs_computed():
    side = SchedulerSide(SPOOL)
    params = {**P.kv_params_for(TAG), "include_output_tokens": True}
    ok, out = side.request_finished(_request(prompt=(1, 2, 3), output=(10, 11, 12), computed=4, params=params), [0])
    assert (ok, out) == (False, None)
    (p,) = side.take_pending()
    assert "4 of 5" in p.error


def test_aborted_before_scheduling():
    side = SchedulerSide(SPOOL)
    ok, params = side.request_finished(_request(computed=0), [])
    assert (ok, params) == (False, None)
    (p,) = side.take_pending()
    assert p.error is not None and "aborted" in p.error
    assert p.token_ids == [] and p.block_ids == []
    assert p.request_tag() == TAG  # the sidecar learns which sample failed
    assert p.file == "hs-cmpl-7.safetensors"


def test_aborted_mid_prefill():
    side = SchedulerSide(SPOOL)
    ok, params = side.request_finished(_request(computed=2), [3])
    assert (ok, params) == (False, None)
    (p,) = side.take_pending()
    assert p.error is not None and "2 of 5" in p.error and "mid-prefill" in p.error
    assert p.request_tag() == TAG and p.block_ids == []


def test_no_prompt_token_ids():
    side = SchedulerSide(SPOOL)
    ok, params = side.request_finished(_request(prompt=None, computed=4), [1])
    assert (ok, params) == (False, None)
    (p,) = side.take_pending()
    assert "prompt" in p.error


@pytest.mark.parametrize("params", [None, {}, {"other": 1}])
def test_plain_request_without_tag_is_still_saved(params):
    side = SchedulerSide(SPOOL)
    ok, out = side.request_finished(_request(params=params), [5, 6])
    assert ok is True and out["hsstream_file"] == "hs-cmpl-7.safetensors"
    (p,) = side.take_pending()
    assert p.tag is None and p.request_tag() is None and p.error is None


def test_malformed_tag_does_not_raise():
    side = SchedulerSide(SPOOL)
    ok, _ = side.request_finished(_request(params={P.KV_PARAMS_KEY: {"key": "nonsense"}}), [5, 6])
    assert ok is True
    (p,) = side.take_pending()
    assert p.tag is None


def test_weird_request_id_gets_a_safe_file(tmp_path):
    side = SchedulerSide(str(tmp_path))
    ok, params = side.request_finished(_request(rid="../../etc/x y"), [1, 2])
    assert ok
    name = params["hsstream_file"]
    assert P.resolve_in_spool(tmp_path, name, must_exist=False).parent == tmp_path.resolve()
    assert params[P.KV_PARAMS_PATH_KEY] == f"{tmp_path}/{name}"


def test_pending_accumulates_in_order():
    side = SchedulerSide(SPOOL)
    side.request_finished(_request(rid="a"), [1, 2])
    side.request_finished(_request(rid="b"), [])
    side.request_finished(_request(rid="c"), [3, 4])
    assert [(p.request_id, p.error is None) for p in side.take_pending()] == [("a", True), ("b", False), ("c", True)]


# ---------------------------------------------------------------------------------- worker

BS, H = 4, 8
USER_LAYERS = [5, 2, 10]
SHAPE = ShapeInfo(layer_ids=USER_LAYERS, num_hidden_layers=12, hidden_size=H, dtype="bfloat16", model="tiny")


def _cache(layout: str, num_blocks: int = 16, k: int = 3, bs: int = BS):
    """(cache as vLLM would hand it, physical token-major tensor) in bf16 with random rows."""
    g = torch.Generator().manual_seed(0)
    phys = torch.randn((num_blocks, bs, k, H), generator=g).to(torch.bfloat16)
    return (phys if layout == "old" else phys.permute(0, 2, 1, 3)), phys


def _expected(phys, block_ids, n, perm):
    rows = torch.stack([phys[block_ids[t // BS], t % BS] for t in range(n)])
    return rows[:, perm] if perm is not None else rows


@pytest.fixture
def writer(spool):
    w = SpoolWriter(spool, None, SHAPE, num_threads=2)
    yield w
    w.close()


@pytest.mark.parametrize("layout", ["old", "new"])
@pytest.mark.parametrize("chunk_tokens", [8192, 5])
def test_gatherer_writes_the_requests_rows(layout, chunk_tokens, spool, writer):
    kv, phys = _cache(layout)
    perm = storage_permutation(USER_LAYERS)
    g = HiddenStateGatherer(kv, BS, len(USER_LAYERS), perm, writer, chunk_tokens=chunk_tokens)

    side = SchedulerSide(str(spool))
    prompt = list(range(100, 111))  # 11 tokens: 3 blocks of 4, the last one partly used
    blocks = [9, 2, 14, 5]  # non-contiguous, one spare
    ok, params = side.request_finished(_request(rid="cmpl-42", prompt=prompt), blocks)
    assert ok
    (p,) = side.take_pending()

    g.submit(p)
    assert g.known("cmpl-42")
    assert g.poll({"cmpl-42", "someone-else"}) == {"cmpl-42"}
    assert not g.known("cmpl-42")
    assert g.poll({"cmpl-42"}) == set()  # reported once
    assert writer.flush(5)

    path = P.resolve_in_spool(spool, params["hsstream_file"])
    assert str(path) == os.path.realpath(params[P.KV_PARAMS_PATH_KEY])
    t = load_file(path)
    assert t[P.TOKEN_IDS_KEY].tolist() == prompt
    assert t[P.HIDDEN_STATES_KEY].dtype == torch.bfloat16
    assert torch.equal(t[P.HIDDEN_STATES_KEY], _expected(phys, blocks, len(prompt), perm))
    with safe_open(str(path), "pt") as f:
        n = P.Notice.decode(f.metadata()[P.HEADER_NOTICE_KEY])
    assert n.status is P.NoticeStatus.ok and n.key == TAG.key and n.layer_ids == USER_LAYERS
    assert os.listdir(spool) == [path.name]


def test_gatherer_without_permutation(spool, writer):
    kv, phys = _cache("new")
    g = HiddenStateGatherer(kv, BS, 3, None, writer)
    p = PendingSave("r1", "r1.safetensors", [1, 2, 3, 4, 5], [7, 3], None)
    g.submit(p)
    assert g.poll({"r1"}) == {"r1"}
    assert writer.flush(5)
    assert torch.equal(load_file(spool / "r1.safetensors")[P.HIDDEN_STATES_KEY], _expected(phys, [7, 3], 5, None))


def test_gatherer_ambiguous_layout_k_equals_block_size(spool, writer):
    # K == block_size == 4: only the strides tell the layouts apart.
    for layout in ("old", "new"):
        kv, phys = _cache(layout, k=4)
        g = HiddenStateGatherer(kv, BS, 4, [3, 0, 2, 1], writer)
        rid = f"amb-{layout}"
        g.submit(PendingSave(rid, f"{rid}.safetensors", list(range(7)), [6, 1], None))
        assert writer.flush(5)
        got = load_file(spool / f"{rid}.safetensors")[P.HIDDEN_STATES_KEY]
        assert torch.equal(got, _expected(phys, [6, 1], 7, [3, 0, 2, 1])), layout


def test_gatherer_too_few_blocks_raises_and_writes_nothing(spool, writer):
    kv, _ = _cache("old")
    g = HiddenStateGatherer(kv, BS, 3, None, writer)
    with pytest.raises(CacheLayoutError):
        g.submit(PendingSave("short", "short.safetensors", list(range(9)), [1, 2], None))
    assert not g.known("short")
    assert writer.flush(5)
    assert os.listdir(spool) == []
    g.mark_done("short")  # what the plug-in does after a failed gather
    assert g.poll({"short"}) == {"short"}


def test_gatherer_rejects_wrong_cache_shape(writer):
    with pytest.raises(CacheLayoutError):
        HiddenStateGatherer(torch.zeros((4, 5, 3, H)), BS, 3, None, writer)


def test_gatherer_copies_so_the_cache_may_be_reused(spool, writer):
    kv, phys = _cache("old")
    want = _expected(phys, [0, 1], 6, None).clone()
    g = HiddenStateGatherer(kv, BS, 3, None, writer)
    g.submit(PendingSave("r", "r.safetensors", list(range(6)), [0, 1], None))
    assert g.poll({"r"}) == {"r"}
    phys.zero_()  # vLLM frees the blocks once poll() reported them
    assert writer.flush(5)
    assert torch.equal(load_file(spool / "r.safetensors")[P.HIDDEN_STATES_KEY], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host: see docs/benchmarks.md)")
@pytest.mark.parametrize("step_marked", [True, False])
def test_on_cuda_the_copy_waits_for_the_work_before_the_step_not_for_the_steps_forward(spool, writer, step_marked):
    """The saves of a step are known once its forward is launched: their copies must wait for
    the previous forward (which wrote the rows), not for this one. The control (no step mark:
    everything queued) shows the check can tell the two apart."""
    _, phys_cpu = _cache("old")
    phys = phys_cpu.cuda()
    g = HiddenStateGatherer(phys, BS, 3, None, writer)
    cur = torch.cuda.current_stream()
    # A first save warms the pinned allocator (a first cudaHostAlloc may wait for the device).
    g.step_starts()
    g.submit(PendingSave("w", "w.safetensors", list(range(6)), [0, 1], None))
    torch.cuda.synchronize()
    assert writer.flush(5) and g.poll({"w"}) == {"w"}
    torch.cuda._sleep(20_000_000)  # the previous step's forward ...
    phys[0:2].fill_(1.0)  # ... writes the rows of the request saved now
    g._step_start = None
    if step_marked:
        g.step_starts()
    torch.cuda._sleep(4_000_000_000)  # this step's forward, launched before the save is known (~2 s)
    phys[5].fill_(7.0)
    g.submit(PendingSave("r", "r.safetensors", list(range(6)), [0, 1], None))
    deadline = time.monotonic() + 1.0
    while not g.poll({"r"}) and time.monotonic() < deadline:
        time.sleep(0.005)
    landed_while_busy = not g.known("r") and not cur.query()
    torch.cuda.synchronize()
    assert landed_while_busy == step_marked  # marked: the copy did not wait for this step's forward
    assert writer.flush(5)
    assert torch.equal(load_file(spool / "r.safetensors")[P.HIDDEN_STATES_KEY], torch.ones(6, 3, H, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------- plug-in


def test_non_writer_rank_reports_and_writes_nothing(spool):
    """TP rank != 0 gets the same metadata but must neither write nor report (count is 1)."""
    from connector.worker_side import WorkerSide

    w = WorkerSide(None, None)  # what the plug-in keeps on a rank other than 0
    pend = [PendingSave("r1", "r1.safetensors", [1, 2, 3], [0], None)]
    assert w.step(pend, {"r1"}) is None
    assert w.step([], set()) is None
    assert os.listdir(spool) == []


def test_writer_rank_writes_reports_and_survives_a_bad_request(spool):
    """Rank 0: a good request is written and reported done; a request whose blocks cannot
    hold its tokens becomes an error notice, is still reported (its blocks must be freed),
    and does not take the step down."""
    from connector.worker_side import WorkerSide

    K, H, bs = 2, 8, 4
    phys = torch.arange(6 * bs * K * H, dtype=torch.float32).reshape(6, bs, K, H).to(torch.bfloat16)
    writer = SpoolWriter(spool, None, ShapeInfo([1, 2], 4, H, "bfloat16", "m"), num_threads=1)
    w = WorkerSide(HiddenStateGatherer(phys, bs, K, None, writer), writer)
    good = PendingSave("good", "good.safetensors", list(range(6)), [3, 1], None)
    bad = PendingSave("bad", "bad.safetensors", list(range(9)), [2], None)  # 9 tokens, 1 block
    done = w.step([good, bad], {"good", "bad"})
    assert done == {"good", "bad"}
    assert writer.flush(5)
    assert sorted(os.listdir(spool)) == ["good.safetensors"]
    got = load_file(spool / "good.safetensors")[P.HIDDEN_STATES_KEY]
    assert torch.equal(got, torch.cat([phys[3], phys[1]])[:6])
    assert w.step([], set()) is None
    writer.close()


def test_writer_rank_refuses_busy_before_copying_when_writers_are_behind(spool, tmp_path):
    """Over the pending-bytes bound, a request gets a "busy" notice at once (no copy, nothing
    written, its blocks reported free) and the step does not wait for the writers."""
    import threading
    import time

    import zmq

    from connector.worker_side import WorkerSide

    K, H, bs = 2, 8, 4
    phys = torch.zeros(6, bs, K, H, dtype=torch.bfloat16)
    ep = f"ipc://{tmp_path}/n.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(ep)
    row = K * H * 2
    writer = SpoolWriter(spool, ep, ShapeInfo([1, 2], 4, H, "bfloat16", "m"), num_threads=1,
                         max_pending_bytes=5 * row)  # fmt: skip
    gate = threading.Event()
    writer._pool.submit(gate.wait)  # the only writer thread is stuck
    g = HiddenStateGatherer(phys, bs, K, None, writer)
    copied = []
    real_submit = g.submit
    g.submit = lambda p, lock=None: (copied.append(p.request_id), real_submit(p, lock))
    try:
        w = WorkerSide(g, writer)
        first = PendingSave("a", "a.safetensors", list(range(4)), [0], P.RequestTag(key=P.SampleKey(job="j", index=0)))
        second = PendingSave("b", "b.safetensors", list(range(4)), [1], P.RequestTag(key=P.SampleKey(job="j", index=1)))
        t0 = time.monotonic()
        done = w.step([first, second], {"a", "b"})
        assert time.monotonic() - t0 < 3.0 and done == {"a", "b"}  # both blocks free: no wait for the stuck writer
        assert copied == ["a"]  # b was refused before its rows were copied
        assert pull.poll(5000)
        n = P.Notice.decode(pull.recv())
        assert n.status == P.NoticeStatus.busy and n.key.index == 1 and "MAX_PENDING_WRITE_BYTES" in n.reason
        assert writer.stats["busy"] == 1
        gate.set()
        assert writer.flush(5) and sorted(os.listdir(spool)) == ["a.safetensors"]
    finally:
        gate.set()  # never leave the writer thread blocked (the interpreter would wait for it)
    writer.close()
    pull.close(linger=0)


def test_notices_without_a_sidecar_are_bounded_and_never_block(spool, tmp_path):
    import time

    writer = SpoolWriter(spool, f"ipc://{tmp_path}/nobody.sock", ShapeInfo([1], 4, 8, "bfloat16", "m"),
                         num_threads=1, max_queued_notices=10)  # fmt: skip
    t0 = time.monotonic()
    for i in range(2000):
        writer.submit_error(f"r{i}", None, "x")
    assert time.monotonic() - t0 < 2.0
    assert writer._notices.qsize() <= 10 and writer.stats["notices_dropped"] >= 2000 - 10 - 10 - 1
    writer.close()
