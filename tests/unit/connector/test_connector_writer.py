"""SpoolWriter: files appear atomically, then a notice says so; every failure is a notice."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from connector import protocol as P  # noqa: E402
from connector import spool_writer as SW  # noqa: E402
from connector.layouts import files as FL  # noqa: E402
from connector.spool_writer import ShapeInfo, SpoolWriter, WriteJob  # noqa: E402

T, K, H = 13, 3, 8
SHAPE = ShapeInfo(layer_ids=[5, 2, 10], num_hidden_layers=12, hidden_size=H, dtype="bfloat16", model="tiny-verifier")
TAG = P.RequestTag(key=P.SampleKey(job="job1", epoch=1, index=4), attempt=2)


@pytest.fixture
def pull(tmp_path):
    """The sidecar's end: a PULL socket bound on an ipc:// endpoint."""
    endpoint = f"ipc://{tmp_path}/n.sock"
    assert len(endpoint) < 100, "ipc path too long for a unix socket"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    yield endpoint, sock
    sock.close()
    ctx.term()


@pytest.fixture
def writer(spool, pull):
    w = SpoolWriter(spool, pull[0], SHAPE, num_threads=2)
    yield w
    w.close()


def _recv(sock, timeout_ms: int = 5000) -> P.Notice:
    assert sock.poll(timeout_ms), "no notice within the timeout"
    return P.Notice.decode(sock.recv())


def _visible(spool) -> list[str]:
    return sorted(n for n in os.listdir(spool) if not n.startswith("."))


def _job(rid: str = "cmpl-1", n: int = T, ntok: int | None = None, seed: int = 0, **kw) -> WriteJob:
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn((n, K, H), generator=g).to(torch.bfloat16)
    ids = list(range(1000 + seed, 1000 + seed + (n if ntok is None else ntok)))
    return WriteJob(rid, P.file_name_for_request(rid), TAG, ids, hs, **kw)


def test_ok_notice_arrives_after_file_is_complete(writer, spool, pull):
    job = _job()
    hs, ids, name = job.hidden_states.clone(), list(job.token_ids), job.file
    t_before = time.time()
    writer.submit(job)
    n = _recv(pull[1])
    t_after = time.time()

    # The file is in place when the notice is received, and no temp file is left over.
    assert (spool / name).is_file()
    assert os.listdir(spool) == [name]
    assert P.resolve_in_spool(spool, name) == (spool / name).resolve()

    assert n.status is P.NoticeStatus.ok and n.reason is None
    assert (n.request_id, n.file, n.key, n.attempt) == ("cmpl-1", name, TAG.key, TAG.attempt)
    assert n.num_tokens == T
    assert n.nbytes == T * K * H * 2
    assert (n.layer_ids, n.num_hidden_layers, n.hidden_size, n.dtype, n.model) == (
        [5, 2, 10], 12, H, "bfloat16", "tiny-verifier",
    )
    assert n.checksum_algo == "blake3"

    tensors = load_file(spool / name)
    assert set(tensors) == {P.HIDDEN_STATES_KEY, P.TOKEN_IDS_KEY}
    got_hs, got_ids = tensors[P.HIDDEN_STATES_KEY], tensors[P.TOKEN_IDS_KEY]
    assert got_hs.dtype == torch.bfloat16 and tuple(got_hs.shape) == (T, K, H)
    assert got_ids.dtype == torch.int64 and tuple(got_ids.shape) == (T,)
    assert torch.equal(got_hs, hs)
    assert got_ids.tolist() == ids

    with safe_open(str(spool / name), "pt") as f:
        meta = f.metadata()
    # The header holds the notice as written; publishing adds only when and how long it took.
    assert P.Notice.decode(meta[P.HEADER_NOTICE_KEY]) == n.model_copy(update={"sent_at": None, "timings": {}})
    assert json.loads(meta[P.HEADER_NOTICE_KEY])["v"] == P.PROTOCOL_VERSION
    assert n.sent_at is not None and t_before <= n.sent_at <= t_after
    assert set(n.timings) == {"gather", "queue", "copy_wait", "checksum", "write"} and n.timings["queue"] >= 0
    assert all(v >= 0 for v in n.timings.values()) and n.timings["write"] > 0

    assert n.checksum == P.checksum(got_hs.view(torch.uint8).numpy(), got_ids.numpy())
    assert os.path.getsize(spool / name) > n.nbytes


def test_file_is_written_under_hidden_name_then_renamed(writer, spool, pull, monkeypatch):
    seen: list[list[str]] = []
    real_save = FL.save_file

    def spy(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        seen.append(sorted(os.listdir(spool)))  # after the write, before the rename

    monkeypatch.setattr(FL, "save_file", spy)
    job = _job("cmpl-atomic")
    writer.submit(job)
    n = _recv(pull[1])
    assert n.status is P.NoticeStatus.ok
    assert len(seen) == 1 and len(seen[0]) == 1
    (during,) = seen[0]
    assert P.is_tmp_name(during) and during.startswith(".")
    assert os.listdir(spool) == [job.file]


def test_reader_never_sees_half_written_file(writer, spool, pull):
    release = threading.Event()
    entered = threading.Event()

    def ready():
        entered.set()
        assert release.wait(10)

    job = _job("cmpl-slow", ready=ready)
    writer.submit(job)
    assert entered.wait(5)
    time.sleep(0.05)
    assert _visible(spool) == []
    assert not pull[1].poll(100), "notice sent before the copy had landed"
    release.set()
    n = _recv(pull[1])
    assert n.status is P.NoticeStatus.ok
    assert _visible(spool) == [job.file] == os.listdir(spool)


def test_row_token_mismatch_is_an_error_notice(writer, spool, pull):
    job = _job("cmpl-bad", n=T, ntok=T + 1)
    writer.submit(job)
    n = _recv(pull[1])
    assert n.status is P.NoticeStatus.error
    assert "13 hidden-state rows for 14 tokens" in (n.reason or "")
    assert n.file is None and n.checksum is None
    assert (n.request_id, n.key, n.attempt) == ("cmpl-bad", TAG.key, TAG.attempt)
    assert os.listdir(spool) == []  # neither file nor temp file
    assert writer.flush(5)


def test_failing_copy_is_an_error_notice(writer, spool, pull):
    def ready():
        raise RuntimeError("device copy failed")

    writer.submit(_job("cmpl-copy", ready=ready))
    n = _recv(pull[1])
    assert n.status is P.NoticeStatus.error
    assert "device copy failed" in (n.reason or "")
    assert os.listdir(spool) == []


def test_failed_save_leaves_no_temp_file(writer, spool, pull, monkeypatch):
    real_save = FL.save_file

    def half_then_fail(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)  # the temp file exists ...
        raise OSError(28, "No space left on device")  # ... then the disk fills up

    monkeypatch.setattr(FL, "save_file", half_then_fail)
    writer.submit(_job("cmpl-full"))
    n = _recv(pull[1])
    # a full spool is no fault of the sample's: "busy", produced again without spending an attempt
    assert n.status is P.NoticeStatus.busy and "No space left" in (n.reason or "")
    assert os.listdir(spool) == []


def test_submit_error(writer, spool, pull):
    writer.submit_error("cmpl-abort", TAG, "request finished before it was scheduled (aborted)")
    n = _recv(pull[1])
    assert n.status is P.NoticeStatus.error
    assert n.reason == "request finished before it was scheduled (aborted)"
    assert (n.request_id, n.key, n.attempt, n.file) == ("cmpl-abort", TAG.key, TAG.attempt, None)
    assert n.layer_ids == [5, 2, 10] and n.model == "tiny-verifier"
    assert os.listdir(spool) == []


def test_submit_error_without_tag(writer, pull):
    writer.submit_error("plain", None, "gather failed")
    n = _recv(pull[1])
    assert n.status is P.NoticeStatus.error and n.key is None and n.attempt == 0


def test_many_jobs_each_get_one_notice(writer, spool, pull):
    jobs = [_job(f"cmpl-{i}", n=1 + i, seed=i) for i in range(8)]
    want = {j.request_id: (j.file, j.hidden_states.clone(), list(j.token_ids)) for j in jobs}
    for j in jobs:
        writer.submit(j)
    got = {}
    for _ in jobs:
        n = _recv(pull[1])
        assert n.request_id not in got
        got[n.request_id] = n
    assert set(got) == set(want)
    assert not pull[1].poll(50)
    assert writer.flush(5)
    assert sorted(os.listdir(spool)) == sorted(f for f, _, _ in want.values())
    for rid, (name, hs, ids) in want.items():
        n = got[rid]
        assert n.status is P.NoticeStatus.ok and n.num_tokens == len(ids)
        t = load_file(spool / name)
        assert torch.equal(t[P.HIDDEN_STATES_KEY], hs)
        assert t[P.TOKEN_IDS_KEY].tolist() == ids
        assert n.checksum == P.checksum(hs.view(torch.uint8).numpy(), torch.tensor(ids).numpy())


def test_writer_without_endpoint_writes_and_flushes(spool):
    w = SpoolWriter(spool, None, SHAPE, num_threads=1)
    try:
        job = _job("cmpl-quiet")
        hs = job.hidden_states.clone()
        w.submit(job)
        assert w.flush(5)
        assert os.listdir(spool) == [job.file]
        assert torch.equal(load_file(spool / job.file)[P.HIDDEN_STATES_KEY], hs)
        w.submit_error("x", None, "no socket: dropped silently")
    finally:
        w.close()


@pytest.mark.parametrize(("algo", "threads"), [("xxh3-128", 1), ("blake3", 1), ("blake3", 0), ("blake3", 3)])
def test_checksum_kind_and_threads_reach_the_digest_unchanged(spool, pull, monkeypatch, algo, threads):
    """HSSTREAM_CHECKSUM / HSSTREAM_CHECKSUM_THREADS, as the plug-in passes them: the notice
    names the kind, the writer hashes on the threads asked for, and the digest is the one any
    reader recomputes (on its own thread count)."""
    calls: list[dict] = []
    real, real_with = SW.SF.sample_checksum, SW.SF.checksum_and_finite

    def spy(tensors, **kw):  # noqa: ANN001, ANN003
        calls.append(kw)
        return real_with(tensors, **kw)

    monkeypatch.setattr(SW.SF, "checksum_and_finite", spy)
    w = SpoolWriter(spool, pull[0], SHAPE, num_threads=1, checksum_algo=algo, checksum_threads=threads)
    try:
        job = _job("cmpl-sum")
        w.submit(job)
        n = _recv(pull[1])
    finally:
        w.close()
    assert calls == [{"algo": algo, "threads": threads}]
    t = load_file(spool / job.file)
    assert n.checksum_algo == algo
    assert n.checksum == real(t, algo=algo, threads=1) == real(t, algo=algo, threads=0)
    # The writer's finiteness verdict comes with a one-thread checksum's pass (none with blake3's).
    assert n.finite is (True if algo in SW.SF.ONE_THREAD_ALGOS else None)


# ----------------------------------------------------------------------------- supervised notice thread


def test_notice_thread_is_restarted_after_an_exception(writer, pull, caplog):
    """Something that breaks the socket's owner thread (here an item send() cannot take) used
    to end it silently: every later notice stayed queued. Now it is logged and restarted."""
    writer._notices.put_nowait(object())  # type: ignore[arg-type]  # send() raises TypeError on it
    writer.submit_error("cmpl-after", TAG, "a later notice")
    n = _recv(pull[1])
    assert (n.request_id, n.reason) == ("cmpl-after", "a later notice")
    assert writer.stats["notice_thread_restarts"] == 1 and writer.stats["notice_thread_dead"] == 0
    assert writer.stats["notices_dropped"] == 1  # the item it failed on
    assert "the notice thread failed: restarting it (1/5)" in caplog.text and "TypeError" in caplog.text
    assert writer._sender.is_alive()


def test_notice_thread_gives_up_loudly_after_bounded_restarts(spool, pull, caplog):
    w = SpoolWriter(spool, pull[0], SHAPE, num_threads=1, max_sender_restarts=2)
    try:
        for _ in range(3):
            w._notices.put_nowait(object())  # type: ignore[arg-type]
        w._sender.join(10)
        assert not w._sender.is_alive()
        assert w.stats["notice_thread_restarts"] == 2 and w.stats["notice_thread_dead"] == 1
        crit = [r for r in caplog.records if r.levelname == "CRITICAL"]
        assert len(crit) == 1 and "failed 3 times in a row: it stays down" in crit[0].getMessage()
        assert "/readyz" in crit[0].getMessage()
    finally:
        w.close()  # returns although the thread is gone
