"""The Example connector's client contract: ``<path>.lock`` held from the step that schedules a
plain request until its file is complete; no lock left behind when no file will come.

The two halves run without vLLM (the plug-in only forwards to them); the reader here does
exactly what vLLM 0.32's ``load_hidden_states`` does (shared flock on the lock, then load).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from connector import protocol as P  # noqa: E402
from connector.contract.spool import LockError, WriteLock  # noqa: E402
from connector.scheduler_side import SchedulerSide  # noqa: E402
from connector.spool_writer import ShapeInfo, SpoolWriter  # noqa: E402
from connector.worker_side import HiddenStateGatherer, WorkerSide  # noqa: E402

BS, K, H = 4, 2, 8
TAG = P.RequestTag(key=P.SampleKey(job="jobA", index=1), attempt=0)


def _request(rid, prompt=(1, 2, 3, 4, 5, 6), params=None, computed=None):
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=params, prompt_token_ids=list(prompt), all_token_ids=list(prompt),
        num_computed_tokens=len(prompt) if computed is None else computed,
    )  # fmt: skip


class Engine:
    """Scheduler side + rank-0 worker side wired as vLLM wires them, one call per step."""

    def __init__(self, spool, **kw):
        self.side = SchedulerSide(str(spool), **kw)
        phys = torch.randn((8, BS, K, H)).to(torch.bfloat16)
        self.phys = phys
        self.writer = SpoolWriter(spool, None, ShapeInfo([1, 2], 4, H, "bfloat16", "m"), num_threads=2)
        self.worker = WorkerSide(HiddenStateGatherer(phys, BS, K, None, self.writer), self.writer)

    def schedule(self, req):
        self.side.request_scheduled(req)  # update_state_after_alloc
        return self.step()  # the step that runs it

    def step(self, finished=()):
        return self.worker.step(self.side.take_pending(), set(finished), self.side.take_new_locks())

    def close(self):
        self.writer.close()
        self.worker.close()


@pytest.fixture
def engine(spool):
    e = Engine(spool)
    yield e
    e.close()


def _held(lock_path) -> bool:
    assert os.path.exists(lock_path), lock_path
    return not P.lock_is_free(lock_path)


def _vllm_style_load(path):
    """vLLM 0.32 ``load_hidden_states``: shared flock on ``<path>.lock`` (sleeps while the
    writer holds it), then load."""
    with open(path + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)
        return load_file(path)


def test_plain_request_lock_exists_and_is_held_before_the_path_is_returned(engine, spool):
    req = _request("cmpl-1")
    engine.schedule(req)
    path = f"{spool}/hs-cmpl-1.safetensors"
    assert os.path.exists(path + ".lock") and _held(path + ".lock")  # before request_finished
    ok, params = engine.side.request_finished(req, [3, 5])
    assert ok and params[P.KV_PARAMS_PATH_KEY] == path

    got: dict = {}
    reader = threading.Thread(target=lambda: got.update(t=_vllm_style_load(path)))
    reader.start()  # the client reads the path at once, before the worker even copied
    time.sleep(0.2)
    assert reader.is_alive() and not os.path.exists(path)  # waiting on the lock, file not there yet
    assert engine.step({"cmpl-1"}) == {"cmpl-1"}
    reader.join(10)
    assert not reader.is_alive()
    assert got["t"][P.TOKEN_IDS_KEY].tolist() == [1, 2, 3, 4, 5, 6]
    assert torch.equal(got["t"][P.HIDDEN_STATES_KEY], torch.cat([engine.phys[3], engine.phys[5]])[:6])
    assert not _held(path + ".lock")  # released; the reader removes it with the file (vLLM's cleanup)
    assert sorted(os.listdir(spool)) == ["hs-cmpl-1.safetensors", "hs-cmpl-1.safetensors.lock"]
    assert P.remove_from_spool(spool, "hs-cmpl-1.safetensors")
    assert os.listdir(spool) == []  # the companion lock goes with the file


def test_sidecar_requests_take_no_lock(engine, spool):
    req = _request("cmpl-2", params=P.kv_params_for(TAG))
    engine.schedule(req)
    assert os.listdir(spool) == []
    engine.side.request_finished(req, [1, 2])
    engine.step({"cmpl-2"})
    assert engine.writer.flush(5)
    assert os.listdir(spool) == ["hs-cmpl-2.safetensors"]


@pytest.mark.parametrize("computed", [0, 3])
def test_aborted_request_leaves_no_lock(engine, spool, computed):
    req = _request("cmpl-3", computed=computed)
    engine.schedule(req)
    assert os.path.exists(f"{spool}/hs-cmpl-3.safetensors.lock")
    ok, params = engine.side.request_finished(req, [] if computed == 0 else [2])
    assert (ok, params) == (False, None)
    engine.step({"cmpl-3"})
    assert engine.writer.flush(5)
    assert os.listdir(spool) == []


def test_request_aborted_after_prefill_writes_nothing(engine, spool):
    req = _request("cmpl-3b")
    engine.schedule(req)
    req.status = SimpleNamespace(name="FINISHED_ABORTED")  # vLLM's RequestStatus, set before request_finished
    ok, params = engine.side.request_finished(req, [1, 2])
    assert (ok, params) == (False, None)
    engine.step({"cmpl-3b"})
    assert engine.writer.flush(5)
    assert os.listdir(spool) == []


def test_waiting_reader_wakes_to_a_missing_file_when_the_write_fails(engine, spool, monkeypatch):
    req = _request("cmpl-4")
    engine.schedule(req)
    path = f"{spool}/hs-cmpl-4.safetensors"
    engine.side.request_finished(req, [1, 2])
    errors: list = []

    def read():
        try:
            _vllm_style_load(path)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.1)
    import connector.layouts.files as SW  # the files layout writes the file

    monkeypatch.setattr(SW, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    engine.step({"cmpl-4"})
    assert engine.writer.flush(5)
    reader.join(10)
    assert not reader.is_alive() and errors and isinstance(errors[0], FileNotFoundError)
    assert os.listdir(spool) == []  # neither file, temp file nor lock


def test_gather_failure_leaves_no_lock(engine, spool):
    req = _request("cmpl-5", prompt=range(20))  # 20 tokens, 1 block: the gather fails
    engine.schedule(req)
    engine.side.request_finished(req, [1])
    assert engine.step({"cmpl-5"}) == {"cmpl-5"}  # blocks still freed
    assert engine.writer.flush(5)
    assert os.listdir(spool) == []


def test_shutdown_releases_and_removes_held_locks(spool):
    e = Engine(spool)
    e.schedule(_request("cmpl-6"))
    assert os.listdir(spool) == ["hs-cmpl-6.safetensors.lock"]
    e.close()
    assert os.listdir(spool) == []


def test_preempted_and_rescheduled_request_keeps_one_lock(engine, spool):
    req = _request("cmpl-7")
    engine.schedule(req)
    engine.schedule(req)  # resumed after a preemption: update_state_after_alloc again
    engine.side.request_finished(req, [1, 2])
    engine.step({"cmpl-7"})
    assert engine.writer.flush(5)
    assert sorted(os.listdir(spool)) == ["hs-cmpl-7.safetensors", "hs-cmpl-7.safetensors.lock"]
    assert not _held(f"{spool}/hs-cmpl-7.safetensors.lock")


def test_lock_held_by_someone_else_fails_the_request_cleanly(engine, spool):
    path = f"{spool}/hs-cmpl-8.safetensors"
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a stale reader of an earlier file of the same name
    try:
        req = _request("cmpl-8")
        engine.schedule(req)  # must not block the engine's step
        assert engine.side.request_finished(req, [1, 2])[0] is True  # the scheduler keeps the blocks for us
        assert engine.step({"cmpl-8"}) == {"cmpl-8"}  # and gets them back at once: nothing to copy
        assert engine.writer.flush(5)
        assert os.listdir(spool) == ["hs-cmpl-8.safetensors.lock"]  # not ours to delete; no data file
        with pytest.raises(LockError, match="held by another process"):
            WriteLock(path)
    finally:
        os.close(fd)
        os.unlink(path + ".lock")


def test_use_synchronization_lock_off(spool):
    e = Engine(spool, use_lock=False)
    try:
        req = _request("cmpl-9")
        e.schedule(req)
        assert os.listdir(spool) == []
        e.side.request_finished(req, [1, 2])
        e.step({"cmpl-9"})
        assert e.writer.flush(5)
        assert os.listdir(spool) == ["hs-cmpl-9.safetensors"]
    finally:
        e.close()


# ------------------------------------------------------------------------- custom paths


def test_custom_path_refused_when_not_allowed(engine, spool, tmp_path):
    want = str(tmp_path / "mine" / "x.safetensors")
    req = _request("cmpl-10", params={P.KV_PARAMS_PATH_KEY: want})
    engine.schedule(req)
    ok, params = engine.side.request_finished(req, [1, 2])
    assert ok is False and "allow_custom_save_path is off" in params[P.KV_PARAMS_ERROR_KEY]
    (p,) = engine.side.take_pending()
    assert "allow_custom_save_path" in p.error  # the error notice's reason
    engine.worker.step([p], {"cmpl-10"})
    assert engine.writer.flush(5)
    assert os.listdir(spool) == [] and not (tmp_path / "mine").exists()


def test_custom_path_written_there_with_its_lock_when_allowed(spool, tmp_path):
    e = Engine(spool, allow_custom_save_path=True)
    try:
        want = tmp_path / "mine" / "sub" / "x.safetensors"
        req = _request("cmpl-11", params={P.KV_PARAMS_PATH_KEY: str(want)})
        e.schedule(req)
        assert _held(str(want) + ".lock")  # directories made, as the Example connector does
        ok, params = e.side.request_finished(req, [4, 6])
        assert ok and params == {P.KV_PARAMS_PATH_KEY: str(want)}
        e.step({"cmpl-11"})
        t = _vllm_style_load(str(want))
        assert t[P.TOKEN_IDS_KEY].tolist() == [1, 2, 3, 4, 5, 6]
        assert os.listdir(spool) == []
        assert sorted(os.listdir(want.parent)) == ["x.safetensors", "x.safetensors.lock"]
    finally:
        e.close()


def test_custom_path_on_a_sidecar_request_is_refused(spool, tmp_path):
    side = SchedulerSide(str(spool), allow_custom_save_path=True)
    req = _request("cmpl-12", params={**P.kv_params_for(TAG), P.KV_PARAMS_PATH_KEY: str(tmp_path / "y.safetensors")})
    side.request_scheduled(req)
    ok, params = side.request_finished(req, [1])
    assert ok is False and "sidecar" in params[P.KV_PARAMS_ERROR_KEY]
    (p,) = side.take_pending()
    assert p.request_tag() == TAG and p.error  # the sidecar hears of it at once


@pytest.mark.parametrize("bad", ["", "  ", 7, "/tmp/dir/"])
def test_custom_path_that_is_no_file_path_is_refused(spool, bad):
    side = SchedulerSide(str(spool), allow_custom_save_path=True)
    req = _request("cmpl-13", params={P.KV_PARAMS_PATH_KEY: bad})
    side.request_scheduled(req)
    assert side.take_new_locks() == {}
    ok, params = side.request_finished(req, [1])
    assert ok is False and "not a file path" in params[P.KV_PARAMS_ERROR_KEY]


# ---------------------------------------------------------------------------- protocol


def test_lock_names():
    assert P.lock_path_for("/s/a.safetensors") == "/s/a.safetensors.lock"
    assert P.is_lock_name("a.safetensors.lock") and P.data_name_of_lock("a.safetensors.lock") == "a.safetensors"
    for bad in ("a.lock", "../a.safetensors.lock", ".a.safetensors.1.tmp", "a.safetensors"):
        assert not P.is_lock_name(bad)
    with pytest.raises(P.UnsafePathError):
        P.data_name_of_lock("x.lock")


def test_remove_from_spool_never_follows_a_lock_symlink(spool, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (spool / "hs-a.safetensors").write_bytes(b"x")
    os.symlink(victim, spool / "hs-a.safetensors.lock")
    assert P.remove_from_spool(spool, "hs-a.safetensors")
    assert victim.read_text() == "keep" and os.path.islink(spool / "hs-a.safetensors.lock")
