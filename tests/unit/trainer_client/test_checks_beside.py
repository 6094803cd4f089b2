"""The host's finiteness scan beside the checksum (``sample_checks._finite_beside``): split
between the ``scan`` pool and the thread that hashes, it must find a NaN or an infinity
wherever it is (the pool's share, the caller's, the cut between them), on any core count, for
files and slots alike, and refuse a bad checksum with nothing left reading the bytes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from connector import protocol as P
from connector.contract import arena as A
from connector.contract.sample_file import InvalidSample
from tests.support import sample_files as SFX
from trainer_client import sample_checks as C
from trainer_client.sample_reader import ArenaMaps

T, LAYERS, HID = 256, [1, 2], 2048  # 1 Mi values: above _BESIDE_MIN, so the scan goes beside


def _write(spool, *, where: float | None, value: float = float("nan"), slot: bool = False, algo="xxh3-128"):
    hs = SFX.random_hidden_states(T, len(LAYERS), HID)
    if where is not None:
        flat = hs.view(-1)
        flat[min(flat.numel() - 1, int(where * flat.numel()))] = value
    kw = {"tokens": T, "layer_ids": LAYERS, "hidden": HID, "hidden_states": hs, "algo": algo,
          "key": P.SampleKey(job="j", index=0)}  # fmt: skip
    if not slot:
        return SFX.write_sample(spool, "hs-0.safetensors", **kw)
    length = SFX.slot_bytes(T, len(LAYERS), HID)
    arena = SFX.make_arena(spool, A.PAGE + length)
    return SFX.write_sample(spool, "hs-0", slot=SFX.slot_for(arena, A.PAGE, length), **kw)


@pytest.mark.parametrize("cpus", [2, 3, 16])
@pytest.mark.parametrize("slot", [False, True], ids=["file", "slot"])
@pytest.mark.parametrize("algo", ["xxh3-128", "blake3"])
def test_a_non_finite_value_is_found_in_either_share_of_the_scan(tmp_path, monkeypatch, cpus, slot, algo):
    monkeypatch.setattr(C, "_CPUS", cpus)
    n = T * len(LAYERS) * HID
    f = (1 + C._XXH3_PER_SCAN) * (cpus - 1) / cpus if algo == "xxh3-128" else 1.0
    cut = int(n * f) / n if f < 1 else 0.5
    for i, where in enumerate((0.0, cut - 1 / n, cut, 0.999999, None)):
        spool = tmp_path / f"s{i}"
        spool.mkdir()
        s = _write(spool, where=where, value=float("inf") if i % 2 else float("nan"), slot=slot, algo=algo)
        maps = ArenaMaps(spool)
        try:
            if where is None:
                got = C.load_and_check(spool, s.deliver, arenas=maps, keep=lambda _a: None)
                assert torch.equal(got.hidden_states, s.hidden_states)
                del got
            else:
                with pytest.raises(InvalidSample, match="non-finite"):
                    C.load_and_check(spool, s.deliver, arenas=maps, keep=lambda _a: None)
        finally:
            maps.close()


@pytest.mark.parametrize("bad", ["checksum", "nan in the caller's share"])
def test_a_refused_sample_waits_for_the_pools_scan_before_it_refuses(tmp_path, monkeypatch, bad):
    """Refused by the checksum, or by a NaN the hashing thread finds in its own share: the pool's
    part of the scan is over before the refusal (a slot is handed back on it)."""
    monkeypatch.setattr(C, "_CPUS", 2)
    seen = []
    real = C._finite_beside
    slow_pool = ThreadPoolExecutor(1)

    def spy(hs, algo):  # the pool's part, made slower than the hashing thread's whole work
        fut, rest = real(hs, algo)
        slow = slow_pool.submit(lambda: (time.sleep(0.3), fut.result())[1])
        seen.append(slow)
        return slow, rest

    monkeypatch.setattr(C, "_finite_beside", spy)
    spool = tmp_path / "s"
    spool.mkdir()
    s = _write(spool, where=None if bad == "checksum" else 0.999999)
    d = s.deliver
    if bad == "checksum":
        d = d.model_copy(update={"notice": s.notice.model_copy(update={"checksum": "0" * 32})})
    with pytest.raises(InvalidSample, match="checksum mismatch" if bad == "checksum" else "non-finite"):
        C.load_and_check(spool, d)
    assert seen and seen[0].done()  # nothing still reads the refused sample's bytes
