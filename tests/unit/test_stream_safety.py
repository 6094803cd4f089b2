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
    name = {"dotdot": "../victim.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[how]
    if how == "symlink":
        os.symlink(outside, spool / "link.safetensors")
    s = HiddenStateStream(ep, spool_dir=spool, timeout_s=5)
    s._connect()
    assert s._take(deliver(name)) is None
    assert s.stats["invalid"] == 1
    assert outside.read_bytes() == b"keep me"
    if how == "symlink":
        assert (spool / "link.safetensors").is_symlink()
    msgs = []
    while sock.poll(500):
        msgs.append(P.decode_msg(sock.recv_multipart()[1:]))
    fails = [m for m in msgs if isinstance(m, P.Fail)]
    assert len(fails) == 1 and "refusing" in fails[0].reason
    s.close()
