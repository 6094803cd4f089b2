"""Disk faults on real full filesystems (issue 40, item 7): each scenario runs in a process of its
own inside a private mount namespace (``unshare --mount``) with a small tmpfs mounted where the
ledger, the spool or an upload's temporary files live, so the kernel answers ENOSPC as a full
volume does (like tests/integration/connector/test_two_hosts.py, this needs root).

- a group commit the ledger's volume refuses neither deletes files nor releases offers: the
  moves wait in memory, the sidecar is degraded (``/readyz`` says so), and once the volume has
  room they are written and only then are the files deleted;
- admission on a full disk is a 507 (once an unhandled 500, or a 400 for an upload);
- a spool with no room is a ``busy`` notice, produced again without spending an attempt (once
  an ``error`` that spent one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from hsstream import launch
from hsstream.devstack import free_port

ROOT = Path(__file__).resolve().parents[3]
MOUNT = 'mount -t tmpfs -o size="$1",mode=0700 hsstream-full "$2" && shift 2 && exec "$@"'


def _namespace_ok() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("a full disk is made with a tmpfs in a private mount namespace: this needs root and "
                    "util-linux's unshare", pytrace=False)  # fmt: skip


def in_tmpfs(where: Path, size: str, cmd: list[str]) -> list[str]:
    """``cmd`` with a fresh tmpfs of ``size`` at ``where``, seen by it alone."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT, "sh", size, str(where), *cmd]


def run_script(where: Path, size: str, script: str, *args: str, timeout: float = 600) -> str:
    _namespace_ok()
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(in_tmpfs(where, size, [sys.executable, "-c", textwrap.dedent(script), str(where), *args]),
                       env=launch.child_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout


GROUP_COMMIT = """
    import os, sys, tempfile
    from pathlib import Path
    from fastapi.testclient import TestClient
    from connector import protocol as P
    from connector.contract.settings import Settings
    from server.app import create_app
    from server.ledger import NewSample

    full, layout = Path(sys.argv[1]), sys.argv[2]  # the ledger's own small tmpfs; the spool layout
    work = Path(tempfile.mkdtemp(dir="/dev/shm"))
    s = Settings(run_dir=work / "run", spool_dir=work / "spool", ledger_path=full / "ledger.sqlite",
                 vllm_url="http://127.0.0.1:9", api_token="t", spool_layout=layout, spool_budget_bytes=4 << 20)
    arena = layout == "arena"
    app = create_app(s)
    svc = app.state.services
    for e in svc.submitter.engines:
        e.model_name = "verifier"
    ledger, spool = svc.ledger, s.spool_dir
    job = ledger.add_job([NewSample(list(range(1000)), None, None, 30) for _ in range(200)]).job_id
    for _ in range(200):
        smp = ledger.next_to_submit(10**9)
        name = f"hs-{smp.key.index}.safetensors"
        if arena:  # a slot of its own (what its bytes are does not matter here)
            ledger.on_notice(P.Notice(status=P.NoticeStatus.ok, request_id=name, key=smp.key, attempt=smp.attempt,
                                      slot=smp.slot, num_tokens=1000, nbytes=30), smp.slot.length)
            continue
        (spool / name).write_bytes(b"x" * 30)
        ledger.on_notice(P.Notice(status=P.NoticeStatus.ok, request_id=name, key=smp.key, attempt=smp.attempt,
                                  file=name, num_tokens=1000, nbytes=30), 30)
    owner = b"Lremote"
    svc.delivery._on_message(owner, P.encode_msg(P.Hello(jobs=[job], same_host=False)))  # zmq: the sidecar deletes
    leased = ledger.lease_many(owner, [job], 200)
    assert len(leased) == 200
    ledger._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the next commit must grow the WAL
    with open(full / "filler", "wb") as f:  # the ledger's volume fills up
        try:
            while True:
                f.write(b"\\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
    msg = P.Received(keys=[x.key for x in leased], tokens=[x.lease_token for x in leased])
    svc.delivery._on_messages(b"L", [[b"remote", *P.encode_msg(msg)]])
    files = sorted(n for n in os.listdir(spool) if n.startswith("hs-"))
    if arena:  # a slot freed now could be given to another sample while the disk still names this one
        held = ledger.arena_stats().slots
        assert held == 200, f"{200 - held} slots freed although their RECEIVEDs are not on disk"
    else:
        assert len(files) == 200, f"{200 - len(files)} files deleted although their RECEIVEDs are not on disk"
    assert ledger.degraded and ledger.next_to_submit(10**9) is None
    print("after a refused commit: 200 files or slots kept,", svc.delivery.stats["unsaved_groups"], "group waiting")
    tc = TestClient(app, raise_server_exceptions=False, headers={"authorization": "Bearer t"})
    ready = tc.get("/readyz").json()
    assert any("cannot write" in p for p in ready["problems"]), ready
    assert tc.post("/v1/jobs", json={"samples": [{"token_ids": [1, 2]}]}).status_code == 503  # while degraded
    os.unlink(full / "filler")  # room again: the next delivery pass writes what waited, then deletes
    svc.delivery.peers.clear()  # (its socket was never bound here: no heartbeat to send)
    svc.delivery._dispatch()
    assert not ledger.degraded, ledger.unsaved()
    left = sorted(n for n in os.listdir(spool) if n.startswith("hs-"))
    assert left == [], left
    if arena:
        assert ledger.arena_stats().slots == 0, ledger.arena_stats()
    on_disk = ledger._db.execute("SELECT count(*) FROM samples WHERE on_disk_bytes = 0 AND state = 'leased'").fetchone()[0]
    assert on_disk == 200, on_disk
    assert not any("cannot write" in p for p in tc.get("/readyz").json()["problems"])
    print("written once there was room:", on_disk, "receipts on disk, files deleted or slots freed")
    svc.ledger.close()
    import shutil
    shutil.rmtree(work, ignore_errors=True)
"""


@pytest.mark.parametrize("layout", ["files", "arena"])
def test_a_refused_group_commit_keeps_files_and_offers_until_it_is_written(tmp_path, layout):
    out = run_script(tmp_path / "ledger-volume", "8m", GROUP_COMMIT, layout)
    assert "written once there was room: 200" in out, out


SPOOL_FULL = """
    import sys, tempfile
    from pathlib import Path
    import torch, zmq
    from connector import protocol as P
    from connector.spool_writer import ShapeInfo, SpoolWriter, WriteJob
    from server.ledger import Ledger, NewSample

    spool = Path(sys.argv[1])  # a tmpfs too small for the sample
    P.claim_spool(spool)
    ep = f"ipc://{tempfile.mkdtemp()}/n.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(ep)
    ledger = Ledger()
    ledger.add_job([NewSample(list(range(400)), None, None, 30)])
    smp = ledger.next_to_submit(10**9)
    attempt = smp.attempt
    shape = ShapeInfo(layer_ids=[1, 2, 3], num_hidden_layers=4, hidden_size=512, dtype="bfloat16", model="m")
    w = SpoolWriter(spool, ep, shape, num_threads=1)
    rid = "cmpl-full"
    hs = torch.randn((400, 3, 512)).to(torch.bfloat16)  # 1.2 MB
    w.submit(WriteJob(rid, P.file_name_for_request(rid), P.RequestTag(key=smp.key, attempt=smp.attempt),
                      list(range(400)), hs))
    assert pull.poll(30000)
    n = P.Notice.decode(pull.recv())
    w.close()
    print("notice:", n.status.value, n.reason)
    assert n.status == P.NoticeStatus.busy and "spool full" in (n.reason or ""), n
    assert sorted(p.name for p in spool.iterdir()) == [P.SPOOL_MARKER], list(spool.iterdir())  # no partial file
    ledger.on_notice(n, 0)
    back = ledger.get(smp.key)
    assert back.state.value == "queued" and back.errors == [] and back.attempt == attempt + 1, back
    print("queued again, no attempt spent")
"""


def test_a_full_spool_is_busy_and_spends_no_attempt(tmp_path):
    out = run_script(tmp_path / "spool", "512k", SPOOL_FULL)
    assert "queued again, no attempt spent" in out, out


def test_admission_on_a_full_disk_is_a_507(tiny_model, tmp_path):
    """A real `hsstream serve` whose ledger and temporary files (an upload's body) are on a
    1 MiB tmpfs: a job too big for it, and an upload too big for it, are 507s; the sidecar
    stays up and takes the next job that fits."""
    _namespace_ok()
    full = tmp_path / "state"
    full.mkdir()
    spool = Path(tempfile.mkdtemp(prefix="hsstream-full-", dir="/dev/shm"))
    port = free_port()
    env = launch.child_env({
        "HSSTREAM_SPOOL_DIR": str(spool), "HSSTREAM_RUN_DIR": str(tmp_path / "run"), "HSSTREAM_PORT": str(port),
        "HSSTREAM_MODEL": tiny_model, "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{free_port()}",
        "HSSTREAM_LEDGER_PATH": str(full / "ledger.sqlite"), "HSSTREAM_API_TOKEN": "t", "TMPDIR": str(full),
    })  # fmt: skip
    child = launch.spawn("sidecar", in_tmpfs(full, "1m", [sys.executable, "-m", "hsstream", "serve"]), env,
                         tmp_path / "sidecar.log", cwd=str(ROOT))  # fmt: skip
    url, auth = f"http://127.0.0.1:{port}", {"authorization": "Bearer t"}
    try:
        launch.wait_http(f"{url}/healthz", child, 180)
        big = [{"token_ids": [i % 500] * 200} for i in range(3000)]  # 2.4 MB of token ids
        r = httpx.post(f"{url}/v1/jobs", json={"samples": big}, headers=auth, timeout=120)
        assert r.status_code == 507 and "nothing was queued" in r.json()["detail"], r.text[:500]
        body = b"".join(b'{"token_ids": [%d]}\n' % i for i in range(150_000))  # 2.8 MB: spooled to TMPDIR
        r = httpx.post(f"{url}/v1/jobs/upload", files={"file": ("big.jsonl", body)}, headers=auth, timeout=120)
        assert r.status_code == 507, r.text[:500]
        time.sleep(0.5)
        r = httpx.post(f"{url}/v1/jobs", json={"samples": [{"token_ids": [1, 2, 3]}]}, headers=auth, timeout=60)
        assert r.status_code == 200, r.text[:500]
        assert child.alive()
    finally:
        child.stop()
        shutil.rmtree(spool, ignore_errors=True)
