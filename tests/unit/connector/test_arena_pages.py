"""The arena's pages: reserved when the sidecar makes it (a tmpfs too small fails then, with the
figures), and mapped ahead of use by each process that opens it (no page faults on a slot's
first read)."""

from __future__ import annotations

import errno
import os
import resource
import time

import pytest

from connector.contract import arena as A
from tests.support import sample_files as SFX

SIZE = 8 << 20
#: Faults this thread may take for other reasons (its own heap): without the prefault, 8 MiB
#: read page by page takes ~512.
SLACK = 2


def faults_reading(arena: A.Arena) -> int:
    """Minor page faults this process takes to read one byte of every page of ``arena``."""
    view = memoryview(arena.map)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    total = 0
    for off in range(0, arena.size, A.PAGE):
        total += view[off]
    after = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    del view
    return after - before


@pytest.fixture
def shm_spool():
    with SFX.shm_spool() as d:  # tmpfs: the arena's real home
        yield d


def test_a_new_arena_has_all_its_pages_allocated(shm_spool):
    a = A.Arena.create(shm_spool, SIZE)
    try:
        assert os.stat(a.path).st_blocks * 512 >= a.size  # not sparse: a full tmpfs fails here, not in a writer
    finally:
        a.close()


def test_prefault_maps_every_page_so_reading_or_writing_the_arena_takes_no_faults(shm_spool):
    made = A.Arena.create(shm_spool, SIZE)
    cold, warm = A.Arena.open(shm_spool), A.Arena.open(shm_spool)
    try:
        assert faults_reading(cold) > SIZE // A.PAGE // 64  # without it: faults (a few pages each)
        warm.prefault(background=False)
        assert warm.prefault_error is None
        assert warm.prefaulted == warm.size
        assert faults_reading(warm) <= SLACK
        view = memoryview(warm.map)  # nor writing it (the connector's case): the pages are mapped writable
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for off in range(A.PAGE, warm.size, A.PAGE):
            view[off] = 7
        assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before <= SLACK
        del view
    finally:
        for x in (cold, warm, made):
            x.close()


def test_a_background_prefault_ends_and_a_close_stops_it_and_unmaps(shm_spool, monkeypatch):
    made = A.Arena.create(shm_spool, 4 * A.PREFAULT_CHUNK)
    try:
        a = A.Arena.open(shm_spool)
        t = a.prefault()
        assert t is not None
        t.join(30)
        assert not t.is_alive() and a.prefaulted == a.size
        a.close()
        assert a.map.closed

        monkeypatch.setattr(A, "PREFAULT_CHUNK", A.PAGE)  # many calls: a close lands between two
        c = A.Arena.open(shm_spool)
        t = c.prefault()
        while c.prefaulted == 0 and t.is_alive():
            time.sleep(0)
        c.close()
        t.join(30)
        assert not t.is_alive()
        assert 0 < c.prefaulted < c.size and c.prefault_error == "closed"
        assert c.map.closed  # unmapped by the prefault itself once it let go of the mapping

        b = A.Arena.open(shm_spool)
        b.close()  # before it starts: it maps nothing and leaves the mapping closed
        assert b.prefault() is None
        assert b.prefaulted == 0 and b.prefault_error == "closed"
        assert b.map.closed
    finally:
        made.close()


def faults_in(arena: A.Arena, start: int, end: int) -> int:
    view = memoryview(arena.map)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    total = 0
    for off in range(start, end, A.PAGE):
        total += view[off]
    after = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    del view
    return after - before


def test_prefault_ahead_maps_from_the_low_end_past_the_slot_in_use_and_no_further(shm_spool, monkeypatch):
    monkeypatch.setattr(A, "PREFAULT_AHEAD_SLOTS", 2)
    length = 16 * A.PAGE
    made = A.Arena.create(shm_spool, A.PAGE + 8 * length)
    a = A.Arena.open(shm_spool)
    try:
        slot = A.Slot(arena=a.id, offset=A.PAGE + length, length=length, generation=1)  # the second slot
        a.prefault_ahead(slot)
        t = a._pf_thread
        if t is not None:
            t.join(30)
        assert a.prefaulted == slot.end + 2 * length  # from 0 through the slot and two more
        assert faults_in(a, 0, a.prefaulted) <= SLACK
        assert faults_in(a, a.prefaulted, a.size) > 0  # what lies further is left to a later call
        a.prefault_ahead(slot)  # nothing more to do: no thread
        assert a._pf_thread is None
        later = A.Slot(arena=a.id, offset=A.PAGE + 5 * length, length=length, generation=2)
        a.prefault_ahead(later)
        if (t := a._pf_thread) is not None:
            t.join(30)
        assert a.prefaulted == a.size  # capped at the arena's end
    finally:
        a.close()
        made.close()


def test_a_tmpfs_too_small_for_the_arena_is_refused_with_the_figures(shm_spool, monkeypatch):
    def full(fd, offset, length):  # noqa: ANN001, ARG001
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(A.ArenaError) as e:
        A.Arena.create(shm_spool, SIZE)
    msg = str(e.value)
    assert f"{SIZE >> 20} MiB" in msg and "MiB free there" in msg and "HSSTREAM_SPOOL_BUDGET_BYTES" in msg
    assert not [n for n in os.listdir(shm_spool) if n.startswith(A.ARENA_NAME)]  # nothing left behind


def test_hsstream_serve_on_a_tmpfs_too_small_for_the_arena_exits_2_with_the_figures(tmp_path):
    """The real sidecar process, its spool on the real /dev/shm, a budget larger than that tmpfs:
    a one-line error and exit 2 at start (no traceback, no arena file), not a writer's SIGBUS later."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    with SFX.shm_spool() as spool:
        st = os.statvfs(spool)
        budget = st.f_blocks * st.f_frsize + (1 << 30)  # more than the whole tmpfs: refused at once
        env = {k: v for k, v in os.environ.items() if not k.startswith("HSSTREAM_")}
        env.update({"HSSTREAM_SPOOL_DIR": str(spool), "HSSTREAM_RUN_DIR": str(tmp_path / "run"),
                    "HSSTREAM_SPOOL_LAYOUT": "arena", "HSSTREAM_SPOOL_BUDGET_BYTES": str(budget),
                    "HSSTREAM_PORT": "1", "PYTHONPATH": str(root)})  # fmt: skip
        p = subprocess.run([sys.executable, "-m", "hsstream", "serve"], env=env, capture_output=True, text=True,
                           timeout=120, cwd=root)  # fmt: skip
        assert p.returncode == 2, p.stderr[-3000:]
        assert f"cannot reserve the arena's {(budget + A.PAGE) >> 20} MiB" in p.stderr, p.stderr[-3000:]
        assert "HSSTREAM_SPOOL_BUDGET_BYTES" in p.stderr and "Traceback" not in p.stderr
        assert not [n for n in os.listdir(spool) if n.startswith(A.ARENA_NAME)]
