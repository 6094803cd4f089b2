"""The host's finiteness check of a delivered sample (``sample_checks._SampleChecks.host_checks``):
the writer's verdict (``Notice.finite``) once the checksum matches, or, without one (or with
``rescan_finite``), a scan that goes with the checksum — shared by chunks between the ``scan``
pool and the hashing thread on several cores, in the checksum's own pass on one. Either way a
NaN or an infinity is found wherever it is, for files and slots alike, and a refused sample has
nothing left reading its bytes."""

from __future__ import annotations

import threading
import time

import pytest

from connector import protocol as P
from connector.contract import arena as A
from connector.contract.finite_scan import CHUNK
from connector.contract.sample_file import InvalidSample
from tests.support import sample_files as SFX
from trainer_client import finite as F
from trainer_client import sample_checks as C
from connector import layouts as L

T, LAYERS, HID = 256, [1, 2], 2048  # 1 Mi values (4 chunks): above _BESIDE_MIN, so the scan goes beside
N = T * len(LAYERS) * HID


def _write(spool, *, where: int | None, value: float = float("nan"), slot: bool = False, algo="xxh3-128", **kw):
    hs = SFX.random_hidden_states(T, len(LAYERS), HID)
    if where is not None:
        hs.view(-1)[where] = value
    args = {"tokens": T, "layer_ids": LAYERS, "hidden": HID, "hidden_states": hs, "algo": algo,
            "key": P.SampleKey(job="j", index=0), **kw}  # fmt: skip
    if not slot:
        return SFX.write_sample(spool, "hs-0.safetensors", **args)
    length = SFX.slot_bytes(T, len(LAYERS), HID)
    arena = SFX.make_arena(spool, A.PAGE + length)
    return SFX.write_sample(spool, "hs-0", slot=SFX.slot_for(arena, A.PAGE, length), **args)


def _check(spool, d, **kw):
    maps = L.Readers(spool)
    try:
        got = C.load_and_check(spool, d, readers=maps, **kw)
        del got
    finally:
        maps.close()


WHERE = (0, CHUNK - 1, CHUNK, 2 * CHUNK + 7, N - 1)


@pytest.mark.parametrize("cpus", [1, 2, 3, 16])
@pytest.mark.parametrize("slot", [False, True], ids=["file", "slot"])
@pytest.mark.parametrize("algo", ["xxh3-128", "blake3"])
def test_without_the_writers_verdict_a_non_finite_value_is_found_anywhere(tmp_path, monkeypatch, cpus, slot, algo):
    """No verdict in the notice (an older writer): the scan, on 1 core in the checksum's pass
    (xxh3-128) or after it (blake3), on several beside it, finds a NaN or an inf at the start,
    either side of a chunk's end, inside, at the end; a clean sample passes."""
    monkeypatch.setattr(C, "CPUS", cpus)
    for i, where in enumerate((*WHERE, None)):
        spool = tmp_path / f"s{i}"
        spool.mkdir()
        s = _write(spool, where=where, value=float("-inf") if i % 2 else float("nan"), slot=slot, algo=algo,
                   finite=None)  # fmt: skip
        assert s.deliver.notice.finite is None
        if where is None:
            _check(spool, s.deliver)
        else:
            with pytest.raises(InvalidSample, match="non-finite hidden states$"):
                _check(spool, s.deliver)


@pytest.mark.parametrize("slot", [False, True], ids=["file", "slot"])
def test_the_writers_verdict_stands_once_the_checksum_matches(tmp_path, monkeypatch, slot):
    """The writer scanned in its checksum's pass: found clean, no scan runs here; found a NaN,
    refused by that verdict. A notice that says clean over a NaN (a writer that lies) is taken
    at its word by default, and refused with ``rescan_finite``."""
    scans = []
    real = C.scan_of
    monkeypatch.setattr(C, "scan_of", lambda hs: scans.append(1) or real(hs))
    monkeypatch.setattr(C, "CPUS", 2)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    clean = _write(tmp_path / "a", where=None, slot=slot)
    assert clean.deliver.notice.finite is True
    _check(tmp_path / "a", clean.deliver)
    assert scans == []
    bad = _write(tmp_path / "b", where=CHUNK + 3, slot=slot)
    assert bad.deliver.notice.finite is False
    with pytest.raises(InvalidSample, match=r"non-finite hidden states \(the writer found them\)"):
        _check(tmp_path / "b", bad.deliver)
    with pytest.raises(InvalidSample, match="the writer found them"):
        _check(tmp_path / "b", bad.deliver, rescan_finite=True)
    lie = _write(tmp_path / "c", where=CHUNK + 3, slot=slot, finite=True)
    _check(tmp_path / "c", lie.deliver)  # the writer's word
    assert scans == []
    with pytest.raises(InvalidSample, match="non-finite hidden states$"):
        _check(tmp_path / "c", lie.deliver, rescan_finite=True)
    assert scans == [1]


@pytest.mark.parametrize("bad", ["checksum", "nan the hashing thread finds"])
def test_a_refused_sample_waits_for_the_pools_scan_before_it_refuses(tmp_path, monkeypatch, bad):
    """Refused by the checksum, or by a NaN in a chunk the hashing thread takes: the pool's
    helper, slowed past the hashing thread's whole work, has finished before the refusal (a
    slot is handed back on it), and the refusal is the sample's own."""
    monkeypatch.setattr(C, "CPUS", 2)
    state = {"running": 0, "ran": 0}
    lock = threading.Lock()
    started = threading.Event()
    real_run = F.ChunkedScan.run

    def slow_run(self, front=True):  # noqa: ANN001
        if not front:
            return real_run(self, front)
        with lock:
            state["running"] += 1
        started.set()
        try:
            time.sleep(0.3)
            return real_run(self, front)
        finally:
            with lock:
                state["running"] -= 1
                state["ran"] += 1

    monkeypatch.setattr(F.ChunkedScan, "run", slow_run)
    real_sum = C.SF.sample_checksum
    # The hashing thread's verdict waits until the helper has started (not a fixed sleep: on a busy
    # host the helper's thread may not run within one), so the helper is always mid-scan at the refusal.
    monkeypatch.setattr(C.SF, "sample_checksum", lambda *a, **k: (started.wait(30), real_sum(*a, **k))[1])
    spool = tmp_path / "s"
    spool.mkdir()
    s = _write(spool, where=None if bad == "checksum" else N - 1, finite=None)
    d = s.deliver
    if bad == "checksum":
        d = d.model_copy(update={"notice": s.notice.model_copy(update={"checksum": "0" * 32})})
    with pytest.raises(InvalidSample, match="checksum mismatch" if bad == "checksum" else "non-finite"):
        C.load_and_check(spool, d)
    assert state["running"] == 0  # nothing still reads the refused sample's bytes
    assert state["ran"] == 1  # it had started (the checksum waited for that): it was waited for


def test_read_hidden_states_takes_the_writers_verdict_unless_told_to_rescan(tmp_path):
    """The drop-in reader follows the stream: a header that says clean over a NaN is taken at
    its word; ``rescan_finite=True`` finds the NaN."""
    from trainer_client.sample_checks import read_hidden_states

    lie = _write(tmp_path, where=CHUNK + 3, finite=True)
    assert read_hidden_states(lie.path).hidden_states.shape[0] == T
    with pytest.raises(InvalidSample, match="non-finite"):
        read_hidden_states(lie.path, rescan_finite=True)
