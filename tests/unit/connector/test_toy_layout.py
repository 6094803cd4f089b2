"""A new spool layout is one module plus one registry line (issue 42, deliverable 3): a toy
layout from the tests alone (``tests/support/toy_layout.py``, each sample a ``torch.save`` file)
is registered with one ``L.register`` and carries one sample end to end: the real connector
writer writes it and sends its notice over ZeroMQ to the real sidecar (``create_app`` with
``spool_layout="toy"``: its notice and delivery threads), which leases it to a
``HiddenStateStream`` that opens it with the toy's reader; the tensors are the ones written, and
nothing is left in the spool or the ledger."""

from __future__ import annotations

import time

import pytest
import torch

from connector import layouts as L
from connector.contract import messages as M
from connector.contract import spool as SP
from connector.contract.settings import Settings
from connector.spool_writer import ShapeInfo, SpoolWriter, WriteJob
from server.app import create_app
from server.ledger import NewSample
from tests.support import toy_layout
from trainer_client import HiddenStateStream

T, LAYERS, H = 6, [1, 3], 8


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(L, "REGISTRY", dict(L.REGISTRY))  # restored afterwards
    L.register("toy", L.Layout("tests.support.toy_layout", "ToySidecar", "ToyWriter", "ToyReader"))  # the one line
    monkeypatch.setattr(toy_layout.ToyWriter, "written", 0)
    monkeypatch.setattr(toy_layout.ToyReader, "opened", 0)


def test_a_toy_layout_from_the_tests_carries_one_sample_writer_to_sidecar_to_stream(toy, tmp_path):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", ledger_path=tmp_path / "ledger.sqlite",
                 vllm_url="http://127.0.0.1:9", api_token="t", spool_layout="toy", spool_budget_bytes=4 << 20)  # fmt: skip
    app = create_app(s)
    svc = app.state.services
    ledger, spool = svc.ledger, s.spool_dir
    ledger.recover(svc.keeper.exists)
    svc.notices.start()
    svc.delivery.start()
    writer = None
    try:
        ids = list(range(100, 100 + T))
        job = ledger.add_job([NewSample(ids, None, "toy", 10_000)]).job_id
        smp = ledger.next_to_submit(10**9)  # what the submitter sends vLLM: the sample's tag
        tag = M.RequestTag(key=smp.key, attempt=smp.attempt)
        hs = torch.randn(T, len(LAYERS), H).to(torch.bfloat16)
        writer = SpoolWriter(spool, svc.notices.endpoint, ShapeInfo(LAYERS, 4, H, "bfloat16", "toy-model"), num_threads=1)
        name = SP.file_name_for_request("toy-cmpl-1")  # the toy's placement: a name of its own
        assert name.startswith(toy_layout.PREFIX)
        writer.submit(WriteJob("toy-cmpl-1", name, tag, ids, hs))
        assert writer.flush(30)
        assert toy_layout.ToyWriter.written == 1
        raw = (spool / name).read_bytes()
        assert not raw[8:9] == b"{"  # torch.save's zip, not a safetensors header
        deadline = time.monotonic() + 30
        while ledger.job_view(job).counts()["ready"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ledger.job_view(job).counts()["ready"] == 1
        with HiddenStateStream(svc.delivery.endpoint, jobs=[job], spool_dir=spool, timeout_s=30) as st:
            got = [(x.key, x.token_ids.clone(), x.hidden_states.clone()) for x in st]
        assert toy_layout.ToyReader.opened == 1
        assert len(got) == 1 and got[0][0] == smp.key
        assert got[0][1].tolist() == ids and torch.equal(got[0][2], hs)
        deadline = time.monotonic() + 10
        left = lambda: sorted(p.name for p in spool.iterdir() if p.name.startswith(SP.FILE_PREFIX))  # noqa: E731
        while (left() or ledger.job_view(job).counts()["consumed"] != 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert left() == []  # the trainer deleted the file it checked
        assert ledger.job_view(job).counts()["consumed"] == 1 and ledger.reserved_bytes == 0
    finally:
        if writer is not None:
            writer.close()
        svc.delivery.stop()
        svc.notices.stop()
        ledger.close()
