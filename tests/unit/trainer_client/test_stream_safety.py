"""HiddenStateStream refuses deliveries that name a path outside the spool: nothing outside
is read or deleted, the sample is reported failed (and so produced again), never yielded."""

from __future__ import annotations

import os

import pytest
import zmq

from connector import protocol as P
from trainer_client import HiddenStateStream


@pytest.fixture
def router(tmp_path):
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    ep = f"ipc://{tmp_path}/d.sock"
    sock.bind(ep)
    yield sock, ep
    sock.close(linger=0)


def deliver(name):
    n = P.Notice(status=P.NoticeStatus.ok, request_id="r", key=P.SampleKey(job="j", index=0), file=name,
                 num_tokens=1, layer_ids=[1], hidden_size=2, dtype="bfloat16", checksum="0")  # fmt: skip
    return P.Deliver(notice=n)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_path_outside_spool_refused_nothing_touched(tmp_path, router, how):
    sock, ep = router
    spool = tmp_path / "spool"
    spool.mkdir()
    outside = tmp_path / "victim.safetensors"
    outside.write_bytes(b"keep me")
    name = {"dotdot": "../victim.safetensors", "absolute": str(outside), "symlink": "hs-link.safetensors"}[how]
    if how == "symlink":
        os.symlink(outside, spool / "hs-link.safetensors")
    s = HiddenStateStream(ep, spool_dir=spool, timeout_s=5)
    s._connect()
    assert s._take(deliver(name)) is None
    assert s.stats["invalid"] == 1
    assert outside.read_bytes() == b"keep me"
    if how == "symlink":
        assert (spool / "hs-link.safetensors").is_symlink()
    msgs = []
    while sock.poll(500):
        msgs.append(P.decode_msg(sock.recv_multipart()[1:]))
    fails = [m for m in msgs if isinstance(m, P.Fail)]
    assert len(fails) == 1 and "refusing" in fails[0].reason
    s.close()


def _real_sample(spool, name, key):
    import torch

    from tests.support import sample_files

    return sample_files.write_sample(spool, name, key=key, hidden_states=torch.ones((3, 1, 2), dtype=torch.bfloat16),
                                     token_ids=[1, 2, 3], layer_ids=[1]).deliver  # fmt: skip


def test_redelivery_of_a_held_sample_is_not_yielded_twice(tmp_path, router):
    """Our lease lapsed while the loop held a sample unacked; the sidecar produced and
    delivered it again. The loop must not see it twice."""
    sock, ep = router
    spool = tmp_path / "spool"
    spool.mkdir()
    key = P.SampleKey(job="j", index=0)
    s = HiddenStateStream(ep, spool_dir=spool, ack="manual", timeout_s=5)
    it = iter(s)
    first = _real_sample(spool, "hs-a.safetensors", key)
    ident = None

    def send(msg):
        sock.send_multipart([ident, *P.encode_msg(msg)])

    import threading

    def sidecar():
        nonlocal ident
        assert sock.poll(5000)
        ident = sock.recv_multipart()[0]
        send(first)
        send(_real_sample(spool, "hs-b.safetensors", key))  # the same key, produced again
        send(P.End())

    t = threading.Thread(target=sidecar)
    t.start()
    got = list(it)
    t.join()
    assert [g.key for g in got] == [key]
    assert s.stats["duplicates"] == 1
    assert not (spool / "hs-a.safetensors").exists() and not (spool / "hs-b.safetensors").exists()
    s.close()


def test_acked_keys_are_remembered_within_a_bound_and_never_yielded_again(tmp_path, router):
    """The acked-key memory is bounded (a long run acks millions); a sample redelivered
    before the sidecar saw our ack is dropped, and a redelivery keeps its key fresh."""
    sock, ep = router
    spool = tmp_path / "spool"
    spool.mkdir()
    s = HiddenStateStream(ep, spool_dir=spool, ack="manual", timeout_s=5, acked_memory=100)
    s._connect()
    keys = [P.SampleKey(job="j", index=i) for i in range(1000)]
    s._used = list(keys)
    s.ack_all_used()
    assert len(s._acked) == 100  # bounded: the oldest 900 are the ledger's to remember
    recent = keys[-1]
    got = s._take(_real_sample(spool, "hs-r.safetensors", recent))
    assert got is None and s.stats["duplicates"] == 1  # acked: never yielded twice
    assert not (spool / "hs-r.safetensors").exists()  # its copy is freed all the same
    first_kept = keys[900]
    s._used = [P.SampleKey(job="j", index=i) for i in range(1000, 1099)]  # 99 newer acks
    s._take(_real_sample(spool, "hs-k.safetensors", first_kept))  # redelivered: refreshed
    s.ack_all_used()
    assert first_kept in s._acked and keys[901] not in s._acked
    s.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_all_finite_matches_torch_on_the_raw_bits(dtype):
    """The stream's finite check reads exponent bits with numpy (no torch thread pool): it must
    agree with torch.isfinite on every kind of value, the largest finite one included."""
    import torch

    from trainer_client.stream import all_finite

    dt = getattr(torch, dtype)
    x = torch.randn(64, 4, 32).to(dt)
    x[0, 0, 0], x[1, 1, 1] = torch.finfo(dt).max, -torch.finfo(dt).tiny
    assert all_finite(x)
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[63, 3, 31] = bad
        assert not all_finite(y) and not bool(torch.isfinite(y).all())


def test_wrong_spool_dir_stops_at_once_and_fails_no_sample(tmp_path, router):
    """A trainer pointed at the wrong spool must not turn every delivery into FAIL (which
    burns the job's attempts): it gets a StreamError at the first delivery, and reports nothing."""
    from trainer_client.stream import StreamError

    sock, ep = router
    spool, wrong = tmp_path / "spool", tmp_path / "elsewhere"
    spool.mkdir()
    wrong.mkdir()
    d = _real_sample(spool, "hs-a.safetensors", P.SampleKey(job="j", index=0))
    s = HiddenStateStream(ep, spool_dir=wrong, timeout_s=5)
    s._connect()
    with pytest.raises(StreamError, match=r"cannot read delivered file 'hs-a.safetensors' in spool_dir .*elsewhere"):
        s._take(d)
    s.close()
    msgs = []
    while sock.poll(300):
        msgs.append(P.decode_msg(sock.recv_multipart()[1:]))
    assert not [m for m in msgs if isinstance(m, P.Fail | P.Received | P.Ack)], msgs
    assert (spool / "hs-a.safetensors").exists()  # still there for the sample's next lease
    os.unlink(spool / "hs-a.safetensors")
