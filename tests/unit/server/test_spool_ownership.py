"""Nothing is deleted without proof of ownership: a spool we marked, a name the connector writes."""

from __future__ import annotations

import os
import stat
import time

import pytest

from connector import protocol as P
from server.ledger import Ledger
from server.spool import SpoolKeeper

WEIGHTS = b"pretend these are 8 GB of model weights"


def _mode(p) -> int:  # noqa: ANN001
    return stat.S_IMODE(os.stat(p).st_mode)


def test_new_spool_is_created_private_and_marked(tmp_path):
    spool = tmp_path / "a" / "spool"
    assert P.claim_spool(spool) is True
    assert _mode(spool) == 0o700 and P.is_marked_spool(spool)
    assert _mode(spool / P.SPOOL_MARKER) == 0o600
    assert P.claim_spool(spool) is False  # ours already: accepted as is


def test_empty_directory_is_marked_and_made_private(tmp_path):
    spool = tmp_path / "empty"
    spool.mkdir(mode=0o755)
    assert P.claim_spool(spool) is True and _mode(spool) == 0o700 and P.is_marked_spool(spool)


def test_model_folder_is_refused_and_untouched(tmp_path):
    spool = tmp_path / "models"
    spool.mkdir()
    (spool / "model.safetensors").write_bytes(WEIGHTS)
    with pytest.raises(P.SpoolNotOurs, match=r"not empty \(model.safetensors\) and has no .hsstream-spool marker"):
        P.claim_spool(spool)
    assert (spool / "model.safetensors").read_bytes() == WEIGHTS
    assert sorted(os.listdir(spool)) == ["model.safetensors"]  # not marked either
    assert P.own_spool_entries(spool) == []


def test_symlinked_or_shared_spool_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    with pytest.raises(P.SpoolNotOurs, match="not a plain directory"):
        P.claim_spool(tmp_path / "link")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(P.SpoolNotOurs, match="not be group- or world-writable"):
        P.claim_spool(shared)


@pytest.mark.parametrize("name", ["model.safetensors", "hs-x.safetensors.bak", "hs-../x.safetensors", ".hs-x.tmp"])
def test_only_the_connectors_names_are_removed_or_retired(tmp_path, name):
    P.claim_spool(tmp_path / "s")
    if "/" not in name:
        (tmp_path / "s" / name).write_bytes(WEIGHTS)
    assert P.remove_from_spool(tmp_path / "s", name) is False
    assert P.retire_from_spool(tmp_path / "s", name) is None
    if "/" not in name:
        assert (tmp_path / "s" / name).read_bytes() == WEIGHTS
    (tmp_path / "s" / "hs-cmpl-1.safetensors").write_bytes(b"x")
    assert P.remove_from_spool(tmp_path / "s", "hs-cmpl-1.safetensors") is True


def test_own_names_cover_files_and_their_temporary_names():
    name = P.file_name_for_request("cmpl-7/0")
    assert P.is_own_name(name) and P.is_own_name(P.tmp_name_for(name))
    assert not P.is_own_name("model.safetensors") and not P.is_own_name(".model.safetensors.12.tmp")


def test_reaper_sweeps_only_own_names_in_a_marked_spool(tmp_path):
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    ours = [P.file_name_for_request("cmpl-1"), P.tmp_name_for(P.file_name_for_request("cmpl-2"))]
    foreign = ["model.safetensors", "notes.txt", ".model.safetensors.1.tmp"]
    for n in ours + foreign:
        (spool / n).write_bytes(WEIGHTS)
    keeper = SpoolKeeper(spool, Ledger(tmp_path / "l.sqlite"))
    assert keeper.sweep(min_age_s=0) == 2
    assert sorted(os.listdir(spool)) == sorted([*foreign, P.SPOOL_MARKER])
    # a spool whose marker went away is not swept at all
    (spool / ours[0]).write_bytes(b"x")
    os.unlink(spool / P.SPOOL_MARKER)
    time.sleep(0.01)
    assert keeper.sweep(min_age_s=0) == 0 and (spool / ours[0]).exists()
    os.unlink(spool / ours[0])


def test_reaper_handles_locks_with_their_files_and_keeps_held_ones(tmp_path):
    """A companion lock goes with its stray file; alone, it is reaped only once its writer let
    go of it (a held flock is a write in progress, whatever its age); a live file's lock stays."""
    from connector.contract.spool import WriteLock

    spool = tmp_path / "spool"
    P.claim_spool(spool)
    keeper = SpoolKeeper(spool, Ledger(), grace_s=0)
    (spool / "hs-stray.safetensors").write_bytes(b"x")
    (spool / "hs-stray.safetensors.lock").write_bytes(b"")
    (spool / "hs-orphan.safetensors.lock").write_bytes(b"")  # its writer released and went away
    held = WriteLock(spool / "hs-writing.safetensors")  # a write in progress holds its flock
    (spool / "other.safetensors.lock").write_bytes(b"")  # not a name we write: never touched
    old = time.time() - 3600
    for n in os.listdir(spool):
        os.utime(spool / n, (old, old))
    assert keeper.sweep(min_age_s=0) == 2
    assert sorted(os.listdir(spool)) == [P.SPOOL_MARKER, "hs-writing.safetensors.lock", "other.safetensors.lock"]
    held.abandon()
    assert not (spool / "hs-writing.safetensors.lock").exists()
    assert P.is_own_name("hs-a.safetensors.lock") and not P.is_own_name("a.safetensors.lock")


def test_a_retired_file_is_gone_from_the_spool_at_once_and_reaped_if_never_deleted(tmp_path):
    """The stream renames a read file out of the spool (microseconds) and frees its bytes on
    another thread; a process killed in between leaves a temporary name the reaper takes."""
    spool = tmp_path / "s"
    P.claim_spool(spool)
    name = P.file_name_for_request("cmpl-9")
    (spool / name).write_bytes(WEIGHTS)
    (spool / (name + P.LOCK_SUFFIX)).write_bytes(b"")
    retired = P.retire_from_spool(spool, name)
    assert retired is not None and retired.parent == spool and P.is_tmp_name(retired.name)
    assert not P.spool_file_exists(spool, name) and not (spool / (name + P.LOCK_SUFFIX)).exists()
    assert retired.read_bytes() == WEIGHTS
    assert P.retire_from_spool(spool, name) is None  # already gone
    keeper = SpoolKeeper(spool, Ledger(tmp_path / "l.sqlite"))
    assert keeper.sweep(min_age_s=0) == 1 and sorted(os.listdir(spool)) == [P.SPOOL_MARKER]


def test_what_a_run_left_is_samples_and_temporaries_not_the_sidecars_own_files(tmp_path):
    """``leftover_entries``: the benchmarks' "nothing leaked" (the arena bench read the sidecar's
    instance lock as a leftover once the sidecar held one)."""
    from connector.contract.arena import ARENA_NAME
    from connector.contract.spool import file_name_for_request, leftover_entries

    spool = tmp_path / "spool"
    assert P.claim_spool(spool) is True
    for name in (ARENA_NAME, P.SIDECAR_LOCK, "notes.txt"):  # the sidecar's own, and a name not ours
        (spool / name).write_bytes(b"x")
    assert leftover_entries(spool) == [] and sorted(P.own_spool_entries(spool)) == sorted([ARENA_NAME, P.SIDECAR_LOCK])
    sample = file_name_for_request("req-1")
    (spool / sample).write_bytes(b"x")
    (spool / f".{sample}.123.tmp").write_bytes(b"x")
    assert sorted(leftover_entries(spool)) == sorted([sample, f".{sample}.123.tmp"])
