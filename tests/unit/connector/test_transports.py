"""The three transports between the real delivery service and the real stream (ipc control
socket, a real ledger, real sample files, a real Mooncake Transfer Engine on loopback): every
sample arrives once, intact, and leaves the spool; refusals and failures say why."""

from __future__ import annotations

import os
import time

import pytest
import torch

from connector import protocol as P
from connector.transport import TransportError
from server.delivery import DeliveryService
from server.ledger import Ledger, NewSample
from trainer_client import HiddenStateStream, StreamError

from tests.support import sample_files


def _fill(ledger: Ledger, spool, n: int, tokens: int = 5) -> tuple[str, dict]:
    """A job of ``n`` samples, each READY with a real file (random states, the real checksum)."""
    P.claim_spool(spool)
    job = ledger.add_job([NewSample(list(range(1, tokens + 1)), None, f"s{i}", 10_000) for i in range(n)]).job_id
    states = {}
    for _ in range(n):
        s = ledger.next_to_submit(10**9)
        f = sample_files.write_sample(spool, f"hs-{s.key.index}.safetensors", tokens=tokens, layer_ids=[1, 2],
                                      hidden=8, token_ids=list(range(1, tokens + 1)), key=s.key, attempt=s.attempt,
                                      seed=s.key.index)  # fmt: skip
        ledger.on_notice(f.notice, os.path.getsize(f.path))
        states[s.key] = f.hidden_states
    return job, states


def _mooncake_sender():
    from connector.transport.mooncake import MooncakeSender

    return MooncakeSender("127.0.0.1")


@pytest.mark.parametrize("transport", ["spool", "zmq", "mooncake"])
def test_every_sample_once_intact_and_the_spool_emptied(tmp_path, transport):
    spool = tmp_path / "spool"
    ledger = Ledger()
    job, states = _fill(ledger, spool, 12)
    mooncake = _mooncake_sender() if transport == "mooncake" else None
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger, mooncake=mooncake)
    svc.start()
    try:
        with HiddenStateStream(svc.endpoint, jobs=[job], spool_dir=spool, timeout_s=30, credit=4,
                               transport=transport) as s:  # fmt: skip
            got = {smp.key: smp.hidden_states.clone() for smp in s}
        assert sorted(got, key=str) == sorted(states, key=str)
        assert all(torch.equal(got[k], states[k]) for k in states)
        deadline = time.monotonic() + 5
        while (P.own_spool_entries(spool) or not ledger.jobs_done([job])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert P.own_spool_entries(spool) == []
        assert ledger.job_view(job).counts()["consumed"] == 12
        assert svc.stats["delivered_remote"] == (0 if transport == "spool" else 12)
        if transport != "spool":
            assert svc.stats[f"delivered_{transport}"] == 12
        if mooncake is not None:
            assert mooncake.registered == 0  # every region let go on RECEIVED
    finally:
        svc.stop()


def test_a_transport_the_sidecar_does_not_offer_is_refused_with_the_reason(tmp_path):
    spool = tmp_path / "spool"
    ledger = Ledger()
    job, _ = _fill(ledger, spool, 1)
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger)  # no Mooncake configured
    svc.start()
    try:
        with pytest.raises(StreamError, match="does not offer transport 'mooncake'.*HSSTREAM_MOONCAKE_HOSTNAME"):
            with HiddenStateStream(svc.endpoint, jobs=[job], spool_dir=spool, timeout_s=10,
                                   transport="mooncake") as s:  # fmt: skip
                list(s)
        assert ledger.job_view(job).counts()["ready"] == 1  # nothing leased, nothing lost
    finally:
        svc.stop()


def test_an_arena_sidecar_refuses_mooncake_with_the_reason(tmp_path):
    """The arena layout serves spool and zmq; Mooncake registers files, so its trainer is told
    why, and nothing is leased."""
    from connector import layouts as L
    from connector.contract import arena as A

    spool = tmp_path / "spool"
    ledger = Ledger()
    job, _ = _fill(ledger, spool, 1)
    arena = A.Arena.create(spool, 4 * A.PAGE)
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger, mooncake=_mooncake_sender(),
                           layout=L.layout("arena").sidecar_class()(arena))  # fmt: skip
    svc.start()
    try:
        with pytest.raises(StreamError, match="spool is an arena.*not 'mooncake'.*HSSTREAM_SPOOL_LAYOUT=files"):
            with HiddenStateStream(svc.endpoint, jobs=[job], spool_dir=spool, timeout_s=10,
                                   transport="mooncake") as s:  # fmt: skip
                list(s)
        assert ledger.job_view(job).counts()["ready"] == 1
    finally:
        svc.stop()
        arena.close()


def test_unknown_or_impossible_transport_refused_at_construction():
    with pytest.raises(ValueError, match="one of spool, zmq, mooncake"):
        HiddenStateStream("ipc:///tmp/x.sock", transport="carrier-pigeon")
    with pytest.raises(ValueError, match="is remote: its spool is on another host"):
        HiddenStateStream("tcp://10.0.0.1:5601", transport="spool", curve_server_key="k", curve_client_cert="c")


def test_mooncake_reads_only_registered_regions(tmp_path):
    """A region is readable while its sample is leased, and refused once released: a trainer
    (or anyone) cannot read spool memory that is not offered to it."""
    from connector.transport.mooncake import MooncakeReceiver

    sender = _mooncake_sender()
    f = tmp_path / "hs-1.safetensors"
    f.write_bytes(os.urandom(4096))
    key = P.SampleKey(job="j", index=1)
    transfer, frame = sender.offer(b"Lx", key, f)
    assert frame is None and transfer["nbytes"] == 4096  # Mooncake's Transfer, as the DELIVER carries it
    n = P.Notice(status=P.NoticeStatus.ok, request_id="r", key=key, file=f.name, num_tokens=1, nbytes=4096)
    d = P.Deliver(notice=n, transfer=transfer)
    rx = MooncakeReceiver("127.0.0.1", retries=1)
    try:
        assert bytes(rx.fetch(d, None)) == f.read_bytes()
        sender.release(key)
        assert sender.registered == 0
        with pytest.raises(TransportError, match="failed 1 times.*reach the sidecar host's Mooncake ports"):
            rx.fetch(d, None)
        # A descriptor asking for far more than the notice's sample is refused, not allocated.
        huge = P.Deliver(notice=n, transfer={**transfer, "nbytes": 1 << 40})
        with pytest.raises(P.ProtocolError, match="transfer of"):
            rx.fetch(huge, None)
    finally:
        rx.close()
        sender.close()


def test_lost_trainer_frees_its_mooncake_regions(tmp_path):
    spool = tmp_path / "spool"
    ledger = Ledger()
    job, _ = _fill(ledger, spool, 3)
    sender = _mooncake_sender()
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger, mooncake=sender)
    owner = b"Lgone"
    svc._on_message(owner, P.encode_msg(P.Hello(jobs=[job], transport="mooncake")))
    svc._on_message(owner, P.encode_msg(P.Credit(n=3)))
    svc._send = lambda *a, **k: None  # no socket bound in this test: the dispatch logic only
    svc._dispatch()
    assert sender.registered == 3
    svc.peers[owner].last_seen -= svc.peer_timeout_s + 1
    svc._dispatch()
    assert sender.registered == 0 and ledger.job_view(job).counts()["ready"] == 3
    sender.close()


def test_bytes_corrupted_in_the_spool_fail_the_checksum_on_arrival_over_mooncake(tmp_path):
    spool = tmp_path / "spool"
    ledger = Ledger(max_attempts=1)
    job, _ = _fill(ledger, spool, 1)
    (f,) = [spool / n for n in P.own_spool_entries(spool)]
    raw = bytearray(f.read_bytes())
    raw[-20] ^= 0x01  # one bit of the hidden states (token ids are the last 40 bytes)
    f.write_bytes(bytes(raw))
    sender = _mooncake_sender()
    svc = DeliveryService(f"ipc://{tmp_path}/run/d.sock", spool, ledger, mooncake=sender)
    svc.start()
    try:
        with HiddenStateStream(svc.endpoint, jobs=[job], spool_dir=spool, timeout_s=20, transport="mooncake") as s:
            assert list(s) == []
            assert s.stats["invalid"] == 1
        view = ledger.job_view(job)
        assert view.counts()["failed"] == 1
        assert any("checksum mismatch" in e for smp in ledger.job_samples(job) for e in (smp.errors or []))
        assert sender.registered == 0 and P.own_spool_entries(spool) == []
    finally:
        svc.stop()
