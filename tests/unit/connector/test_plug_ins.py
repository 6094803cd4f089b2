"""Adding a payload dtype or a transport is one module plus one registry line: one temporary
module defines a dummy codec (float8_e5m2, no scales) and a dummy transport (the file's bytes
reversed in the payload frame, with a descriptor of its own), registers both, and a sample runs
through each: the real spool writer → a real file → the real stream reader and checks for the
codec; the real delivery service → the real stream over ZeroMQ for the transport."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
import time

import pytest
import torch
import zmq

from connector.contract import messages as M
from connector.contract import payload as PL
from connector.contract import spool as SP
from connector import transport as T
from connector.contract.settings import Settings
from connector.spool_writer import ShapeInfo, SpoolWriter, WriteJob
from server.app import offer_transports
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample
from trainer_client import HiddenStateStream, InvalidSample, read_hidden_states
from trainer_client.sample_checks import load_and_check

from tests.support import sample_files

PLUGIN = '''
from connector.contract import payload as PL
from connector.contract import messages as M
from connector import transport as T


class E5m2(PL.PayloadCodec):
    dtype, safetensors_dtype, itemsize, setting = "float8_e5m2", "F8_E5M2", 1, "fp8_e5m2"
    encoded = True
    finite_bits = ("uint8", 0x7C)  # e5m2: exponent 11111 is an infinity or a NaN


class ReversedSender(T.Sender):
    name = "reversed"

    def offer(self, owner, key, path):
        data = path.read_bytes()
        return {"length": len(data)}, data[::-1]


class ReversedReceiver(T.Receiver):
    name = "reversed"

    def fetch(self, d, frame):
        if frame is None or d.transfer is None or d.transfer.get("length") != len(frame):
            raise M.ProtocolError("reversed: no frame, or not the length its descriptor says")
        return frame[::-1]


def register():
    PL.register(E5m2())
    T.register("reversed", T.Way(__name__, "ReversedSender", "ReversedReceiver"))
'''

T_, K, H = 7, 2, 16


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The temporary module, imported and registered; the registries restored afterwards."""
    path = tmp_path / "hsstream_dummy_plugin.py"
    path.write_text(textwrap.dedent(PLUGIN))
    spec = importlib.util.spec_from_file_location("hsstream_dummy_plugin", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hsstream_dummy_plugin", mod)
    spec.loader.exec_module(mod)
    saved = (dict(PL.CODECS), dict(PL.ELEMENT_SIZES), dict(PL.SCALE_BYTES_PER_TOKEN), dict(T.REGISTRY))
    mod.register()
    yield mod
    for d, old in zip((PL.CODECS, PL.ELEMENT_SIZES, PL.SCALE_BYTES_PER_TOKEN, T.REGISTRY), saved):
        d.clear()
        d.update(old)


def _write(spool, hs: torch.Tensor, dtype: str) -> tuple[str, M.Notice]:
    """One sample through the real writer (and its notice socket) with stored dtype ``dtype``."""
    endpoint = f"ipc://{spool}/n.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    shape = ShapeInfo(layer_ids=[1, 3], num_hidden_layers=4, hidden_size=H, dtype=dtype, model="dummy")
    w = SpoolWriter(spool, endpoint, shape, num_threads=1)
    try:
        name = SP.file_name_for_request("cmpl-plugin")
        tag = M.RequestTag(key=M.SampleKey(job="plug", index=0))
        w.submit(WriteJob("cmpl-plugin", name, tag, list(range(100, 100 + T_)), hs))
        assert pull.poll(10_000), "no notice from the writer"
        notice = M.Notice.decode(pull.recv())
    finally:
        w.close()
        pull.close(linger=0)
        ctx.term()
    assert notice.status == M.NoticeStatus.ok, notice.reason
    return name, notice


def test_a_registered_codec_goes_writer_to_file_to_stream_reader(plugin, tmp_path):
    spool = tmp_path / "spool"
    SP.claim_spool(spool)
    assert "fp8_e5m2" in PL.payload_dtypes() and PL.stored_dtype("fp8_e5m2", "bfloat16") == "float8_e5m2"
    assert PL.bytes_per_position(K, H, "float8_e5m2") == K * H  # priced by the sidecar's sizer as well
    hs = (torch.randn(T_, K, H) * 4).to(torch.bfloat16)
    name, notice = _write(spool, hs, "float8_e5m2")
    assert notice.dtype == "float8_e5m2" and notice.nbytes == T_ * K * H
    want = hs.to(torch.float8_e5m2).to(torch.bfloat16)
    # The mapped reader (safetensors) and the pinned one (the contract's header parser).
    smp = read_hidden_states(spool / name)
    assert smp.hidden_states.dtype == torch.bfloat16 and torch.equal(smp.hidden_states, want)
    d = M.Deliver(notice=notice)
    raw = load_and_check(spool, d, pin_memory=True, alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    assert raw.hidden_states.dtype == torch.float8_e5m2 and torch.equal(raw.dequantized(torch.bfloat16).hidden_states, want)
    assert smp.token_ids.tolist() == list(range(100, 100 + T_))


def test_a_registered_codecs_finite_mask_refuses_an_infinity(plugin, tmp_path):
    spool = tmp_path / "spool"
    SP.claim_spool(spool)
    hs = torch.randn(T_, K, H).to(torch.bfloat16)
    hs[3, 1, 5] = float("inf")  # e5m2 keeps it an infinity; the checksum is over it, so only the mask can tell
    name, notice = _write(spool, hs, "float8_e5m2")
    with pytest.raises(InvalidSample, match="non-finite"):
        read_hidden_states(spool / name)


def test_an_unregistered_dtype_is_refused(tmp_path):
    assert "float8_e5m2" not in PL.CODECS
    with pytest.raises(PL.PayloadError, match="fp8_e5m2"):
        PL.check_payload_dtype("fp8_e5m2")


def test_a_registered_transport_carries_samples_from_the_delivery_service_to_the_stream(plugin, tmp_path):
    spool = tmp_path / "spool"
    SP.claim_spool(spool)
    ledger = Ledger()
    job = ledger.add_job([NewSample(list(range(1, 6)), None, f"s{i}", 10_000) for i in range(3)]).job_id
    states = {}
    for _ in range(3):
        s = ledger.next_to_submit(10**9)
        f = sample_files.write_sample(spool, f"hs-{s.key.index}.safetensors", tokens=5, layer_ids=[1, 2], hidden=8,
                                      token_ids=torch.arange(1, 6), key=s.key, attempt=s.attempt,
                                      seed=s.key.index)  # fmt: skip
        ledger.on_notice(f.notice, os.path.getsize(f.path))
        states[s.key] = f.hidden_states
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger)
    offer_transports(svc, Settings())  # as the sidecar does: every registered way its settings configure
    assert "reversed" in svc.senders
    svc.start()
    try:
        with HiddenStateStream(svc.endpoint, jobs=[job], spool_dir=spool, timeout_s=30, transport="reversed") as st:
            got = {smp.key: smp.hidden_states.clone() for smp in st}
        assert sorted(got, key=str) == sorted(states, key=str)
        assert all(torch.equal(got[k], states[k]) for k in states)
        deadline = time.monotonic() + 5
        while SP.own_spool_entries(spool) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert SP.own_spool_entries(spool) == []  # the sidecar deleted each on RECEIVED
        assert svc.stats["delivered_reversed"] == 3
    finally:
        svc.stop()


def test_a_transport_name_nobody_registered_is_refused_by_the_stream():
    with pytest.raises(ValueError, match="transport 'reversed': one of spool, zmq, mooncake"):
        HiddenStateStream("ipc:///tmp/x.sock", transport="reversed")
