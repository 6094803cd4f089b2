"""HiddenStateStream with its check pool, against a stand-in sidecar (a ROUTER socket): a burst
of deliveries is checked in parallel but yielded in delivery order; an invalid sample among good
ones is reported failed exactly once; every file the stream read is removed once; credit comes
back once per delivery; the pool never holds more than the credit; close() mid-burst leaves no
worker thread and no file it read. (The real sidecar and vLLM: tests/integration.)"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
import zmq

from connector import protocol as P
from trainer_client import HiddenStateStream, StreamError
from trainer_client import sample_reader
from trainer_client import stream as S
from trainer_client.check_pool import THREAD_PREFIX
from trainer_client.stream import InvalidSample, to_device_checked

from tests.support import sample_files


def write_sample(spool, i: int, tokens: int = 32, bad: str | None = None) -> P.Deliver:
    return sample_files.write_sample(spool, f"hs-{i}.safetensors", key=P.SampleKey(job="j", index=i), seed=i,
                                     tokens=tokens, layer_ids=[1, 2], hidden=64, corrupt=bad).deliver  # fmt: skip


class FakeSidecar:
    """Sends the deliveries as one burst once the stream says HELLO (honouring its credit unless
    ``ignore_credit``), then END; records everything the stream sends."""

    def __init__(self, tmp_path, deliveries: list[P.Deliver], *, ignore_credit: bool = False, end: bool = True,
                 on_msg=None) -> None:  # noqa: ANN001
        self.on_msg = on_msg  # called with each message as it arrives (on this fake's thread)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.endpoint = f"ipc://{tmp_path}/d.sock"
        self.sock.bind(self.endpoint)
        self.todo, self.ignore_credit, self.end = list(deliveries), ignore_credit, end
        self.got: list = []
        self.max_outstanding = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        ident, credit, sent_end = None, 0, False
        while not self._stop.is_set():
            if self.sock.poll(20):
                frames = self.sock.recv_multipart()
                ident, msg = frames[0], P.decode_msg(frames[1:])
                self.got.append(msg)
                if self.on_msg is not None:
                    self.on_msg(msg)
                if isinstance(msg, P.Credit):
                    credit += msg.n
            while ident is not None and self.todo and (credit > 0 or self.ignore_credit):
                self.sock.send_multipart([ident, *P.encode_msg(self.todo.pop(0))])
                credit -= 1
            if ident is not None and not self.todo and self.end and not sent_end:
                self.sock.send_multipart([ident, *P.encode_msg(P.End())])
                sent_end = True

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)
        self.sock.close(linger=0)

    def of(self, kind) -> list:  # noqa: ANN001
        return [m for m in self.got if isinstance(m, kind)]

    def keys(self, kind) -> list:  # noqa: ANN001
        return [k for m in self.of(kind) for k in m.keys]


def _workers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


@pytest.mark.parametrize(("workers", "ordered"), [(0, True), (1, True), (4, True), (4, False)])
def test_a_burst_is_yielded_in_order_or_as_checked_with_one_invalid_sample_failed_once(tmp_path, workers, ordered,
                                                                                       monkeypatch):  # fmt: skip
    spool = tmp_path / "spool"
    spool.mkdir()
    ds = [write_sample(spool, i, bad="nan" if i == 5 else None) for i in range(16)]
    real, finished = S.load_and_check, []
    others_done, others_yielded = threading.Event(), threading.Event()

    def slow_first(spool_, d, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if d.notice.key.index == 0 and workers > 1:
            # With workers the first delivery is checked last: it waits (for events, not for a
            # while) until every other check is done and, as checked, every other sample is
            # yielded — in delivery order none can be, so there only the checks.
            others_done.wait(10)
            if not ordered:
                others_yielded.wait(10)
        try:
            return real(spool_, d, *a, **kw)
        finally:
            finished.append(d.notice.key.index)
            if len(finished) == 15 and 0 not in finished:
                others_done.set()

    monkeypatch.setattr(S, "load_and_check", slow_first)
    sc = FakeSidecar(tmp_path, ds)
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=spool, credit=16, timeout_s=20, workers=workers,
                               ordered=ordered) as s:  # fmt: skip
            got = []
            for x in s:
                if x is not None:
                    got.append(x)
                    if len(got) == 14:  # the 16 less the slow first and the invalid one
                        others_yielded.set()
        time.sleep(0.2)
    finally:
        sc.stop()
    good = [d.notice.key for i, d in enumerate(ds) if i != 5]
    if ordered:
        assert [x.key for x in got] == good
    else:  # as checked: the slow first one comes last, held back by none and holding back none
        assert sorted((x.key for x in got), key=str) == sorted(good, key=str) and got[-1].key == good[0]
    fails = sc.of(P.Fail)
    assert [f.key for f in fails] == [ds[5].notice.key] and "non-finite" in fails[0].reason
    assert sorted(sc.keys(P.Received), key=str) == sorted(good, key=str)  # each once, not the failed one
    assert Counter(sc.keys(P.Ack)) == Counter(good)  # ack="use": every yielded sample once
    said = [(type(m), k) for m in sc.got if isinstance(m, (P.Received, P.Ack)) for k in m.keys]
    assert all(said.index((P.Received, k)) < said.index((P.Ack, k)) for k in good)  # the file's news first
    credit = sc.of(P.Credit)
    assert credit[0].n == 16 and sum(c.n for c in credit[1:]) == 16  # one back per delivery
    assert sorted(p.name for p in spool.iterdir()) == ["hs-5.safetensors"]  # the failed one: the sidecar's
    assert s.stats["invalid"] == 1 and s.stats["yielded"] == 15 and s.stats["delivered"] == 16
    t = got[3].timings
    assert t["received"] <= t["started"] <= t["checked"] <= t["handed"]
    assert {"read_s", "checksum_s", "finite_s"} <= set(t)
    assert not _workers_alive()
    if workers > 1:
        assert finished[-1] == 0  # checked out of order (and yielded in order if ordered)


@pytest.mark.parametrize("ack", ["use", "manual"])
def test_a_samples_received_comes_once_its_bytes_are_freed_and_before_its_ack(tmp_path, monkeypatch, ack):
    """RECEIVED frees the sample's share of the sidecar's spool budget, so it may only go once
    the file's bytes are gone, renamed copy included — with a deleter slower than the loop (as
    freeing 33.5 MB is) — and still before the sample's ACK."""
    spool = tmp_path / "spool"
    spool.mkdir()
    ds = [write_sample(spool, i) for i in range(8)]
    real_unlink = S._unlink

    def slow_unlink(path):  # noqa: ANN001, ANN202
        time.sleep(0.05)
        real_unlink(path)

    monkeypatch.setattr(S, "_unlink", slow_unlink)
    early: list = []

    def on_msg(msg) -> None:  # noqa: ANN001
        if isinstance(msg, P.Received):
            for k in msg.keys:
                name = f"hs-{k.index}.safetensors"
                if left := [p.name for p in spool.iterdir() if name in p.name]:
                    early.append((k.index, left))

    sc = FakeSidecar(tmp_path, ds, on_msg=on_msg)
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=spool, credit=8, timeout_s=20, workers=2, ack=ack) as s:
            for x in s:
                if ack == "manual":
                    s.ack_through(x.key)
        time.sleep(0.2)
    finally:
        sc.stop()
    assert early == [], f"RECEIVED before the bytes were freed: {early}"
    keys = [d.notice.key for d in ds]
    assert sorted(sc.keys(P.Received), key=str) == sorted(keys, key=str)  # each once
    said = [(type(m), k) for m in sc.got if isinstance(m, (P.Received, P.Ack)) for k in m.keys]
    assert all(said.index((P.Received, k)) < said.index((P.Ack, k)) for k in keys)
    assert list(spool.iterdir()) == []


def test_the_pool_never_holds_more_than_the_credit_even_from_a_sidecar_that_ignores_it(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    ds = [write_sample(spool, i) for i in range(40)]
    sc = FakeSidecar(tmp_path, ds, ignore_credit=True)
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=spool, credit=4, timeout_s=20, workers=3) as s:
            got = []
            for x in s:
                got.append(x.key)
                time.sleep(0.005)  # a slow loop: deliveries pile up in the socket, not in the pool
            pool = s._pool
    finally:
        sc.stop()
    assert sorted(got, key=str) == sorted((d.notice.key for d in ds), key=str)  # each once
    assert pool.max_held <= 4 and pool.max_running <= 3
    assert not list(spool.iterdir())


def test_close_mid_burst_settles_what_was_read_and_stops_every_worker(tmp_path, monkeypatch):
    spool = tmp_path / "spool"
    spool.mkdir()
    ds = [write_sample(spool, i, tokens=512) for i in range(16)]
    real, streams = S.load_and_check, []

    def second_waits_for_the_burst(spool_, d, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        # The second sample's check waits (for the pool, not for a while) until the stream has
        # taken more deliveries than it will yield: on a loaded machine the burst can otherwise
        # still be in the socket when the loop gets its two samples, and nothing is mid-burst.
        if d.notice.key.index == 1:
            t0 = time.monotonic()
            while len(streams[0]._pool) < 4 and time.monotonic() - t0 < 10:
                time.sleep(0.002)
        return real(spool_, d, *a, **kw)

    monkeypatch.setattr(S, "load_and_check", second_waits_for_the_burst)
    sc = FakeSidecar(tmp_path, ds, end=False)
    s = HiddenStateStream(sc.endpoint, spool_dir=spool, credit=16, timeout_s=20, workers=4, ack="manual")
    streams.append(s)
    try:
        it = iter(s)
        first = [next(it), next(it)]
        held = len(s._pool)
        assert held > 0  # mid-burst: samples delivered, being checked, not yielded
        s.ack_through(first[-1].key)
        s.close()
        assert not _workers_alive()
        time.sleep(0.3)
    finally:
        s.close()  # again, harmless; on a failed assertion above it stops the workers for the next test
        sc.stop()
    received = sc.keys(P.Received)
    assert len(received) == len(set(received))  # never twice
    assert sc.keys(P.Ack) == [x.key for x in first]  # only what the loop had: the rest comes back
    assert not sc.of(P.Fail)
    left = {p.name for p in spool.iterdir()}
    for d in ds:  # a file is gone exactly when its RECEIVED went (read by us), else it is the sidecar's
        assert (d.notice.file in left) == (d.notice.key not in received), d.notice.file
    assert len(received) >= 2 + held


def test_a_wrong_spool_dir_stops_the_pooled_stream_and_reports_nothing(tmp_path):
    spool, wrong = tmp_path / "spool", tmp_path / "elsewhere"
    spool.mkdir()
    wrong.mkdir()
    ds = [write_sample(spool, i) for i in range(6)]
    sc = FakeSidecar(tmp_path, ds)
    try:
        # whichever read fails first (samples are settled as their checks finish) stops the stream
        with pytest.raises(StreamError, match=r"cannot read delivered file 'hs-\d\.safetensors' in spool_dir .*elsewhere"):
            with HiddenStateStream(sc.endpoint, spool_dir=wrong, credit=8, timeout_s=20, workers=4) as s:
                list(s)
        time.sleep(0.3)
    finally:
        sc.stop()
    assert not sc.of(P.Fail) and not sc.of(P.Received) and not sc.of(P.Ack)
    assert len(list(spool.iterdir())) == 6  # every file still there for its next lease
    assert not _workers_alive()


def test_finiteness_on_a_device_refuses_non_finite_values_and_returns_them_there():
    hs = torch.randn(8, 2, 16).to(torch.bfloat16)
    out, sc = to_device_checked(hs, None, torch.device("cpu"), (t := {}))
    assert torch.equal(out, hs) and sc is None and "to_device_s" in t
    hs[7, 1, 15] = float("inf")
    with pytest.raises(InvalidSample, match="non-finite"):
        to_device_checked(hs, torch.ones(8, 1, 1), torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host: see docs/benchmarks.md)")
def test_the_stream_checks_finiteness_on_cuda_and_yields_samples_there(tmp_path, monkeypatch):
    monkeypatch.setattr(sample_reader, "READ_PART", 1000)  # each file in parts, copied to the GPU one by one
    spool = tmp_path / "spool"
    spool.mkdir()
    # 1: NaN (caught on the GPU); 3: a wrong checksum (caught on the host while its copy to the
    # GPU is already under way: that copy must be dropped, not yielded).
    ds = [write_sample(spool, i, bad={1: "nan", 3: "checksum"}.get(i)) for i in range(5)]
    sc = FakeSidecar(tmp_path, ds)
    try:
        with HiddenStateStream(sc.endpoint, spool_dir=spool, credit=4, timeout_s=20, workers=2, device="cuda") as s:
            got = list(s)
    finally:
        sc.stop()
    assert sorted(x.key.index for x in got) == [0, 2, 4] and all(x.hidden_states.is_cuda for x in got)
    assert sorted(f.key.index for f in sc.of(P.Fail)) == [1, 3]
    for x in got:  # what reached the GPU is the file's content, complete
        want = torch.randn((32, 2, 64), generator=torch.Generator().manual_seed(x.key.index)).to(torch.bfloat16)
        assert torch.equal(x.hidden_states.cpu(), want)


def test_the_device_finiteness_flag_reads_fp8_on_its_bits_where_isfinite_has_no_kernel():
    """``torch.isfinite`` has no FP8 kernel on CUDA (found on the H200: every FP8 sample of a
    device trainer failed): an FP8 payload is tested on its exponent bits, with the same answer."""
    from trainer_client.device_copy import finite_flag

    x = torch.randn(64, 2, 8).to(torch.float8_e4m3fn)
    assert bool(finite_flag(x))
    raw = x.view(-1).view(torch.uint8)
    for nan in (0x7F, 0xFF):  # e4m3fn's NaNs (it has no infinity)
        raw[5] = nan
        assert not bool(finite_flag(x))
    raw[5] = 0x7E  # 448, the largest finite value
    assert bool(finite_flag(x))
    b = torch.randn(4, 4).bfloat16()
    assert bool(finite_flag(b))
    b[1, 1] = float("-inf")
    assert not bool(finite_flag(b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host: see docs/benchmarks.md)")
def test_an_fp8_sample_is_checked_for_nans_on_cuda():
    hs = torch.randn(8, 2, 16).to(torch.float8_e4m3fn)
    out, sc = to_device_checked(hs, torch.ones(8, 1, 1), torch.device("cuda"))
    assert out.is_cuda and torch.equal(out.cpu().view(torch.uint8), hs.view(torch.uint8)) and sc.is_cuda
    hs.view(-1).view(torch.uint8)[3] = 0x7F
    with pytest.raises(InvalidSample, match="non-finite"):
        to_device_checked(hs, torch.ones(8, 1, 1), torch.device("cuda"))
