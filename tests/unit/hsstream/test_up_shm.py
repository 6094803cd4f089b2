"""`hsstream up` removes the /dev/shm files a dead vLLM left (a SIGKILL or an OOM kill skips
vLLM's own clean-up). Only files that engine's processes made are removed: mapped by its
process group, absent from /dev/shm before it started, owned by this user, and mapped by no
live process when it is gone. A file vLLM only had mapped (someone else's, or one that was
there before) stays."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from hsstream.up import group_shm_files, remove_shm_files, shm_snapshot
from tests.support import semaphores

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.isdir("/proc/self"), reason="Linux only")

# An "engine": maps a file that was there before it started, makes and maps its own, and one
# it hands to another user (root only), then waits to be killed.
_ENGINE = textwrap.dedent("""
    import mmap, os, sys, time
    pre, own, given = sys.argv[1:4]
    maps = []
    def mapped(path, create):
        if create:
            with open(path, "wb") as f:
                f.write(b"x" * 4096)
        f = open(path, "r+b")
        maps.append((f, mmap.mmap(f.fileno(), 4096)))
    mapped(pre, False)
    mapped(own, True)
    if os.geteuid() == 0:
        mapped(given, True)
        os.chown(given, 65534, 65534)
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def names(request):
    base = f"/dev/shm/hsstream-unit-{os.getpid()}-{request.node.name[-20:]}"
    paths = {k: f"{base}-{k}" for k in ("pre", "own", "given", "shared")}
    yield paths
    for p in paths.values():
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _engine(names) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _ENGINE, names["pre"], names["own"], names["given"]],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert p.stdout.readline().strip() == "ready"
    return p


def test_only_files_the_dead_engine_made_are_recorded_and_removed(names):
    with open(names["pre"], "wb") as f:
        f.write(b"p" * 4096)  # there before the engine: someone else's, which it only maps
    before = shm_snapshot()
    eng = _engine(names)
    try:
        got = group_shm_files(eng.pid, before)
    finally:
        eng.kill()
        eng.wait()
    assert names["own"] in got
    assert names["pre"] not in got, "a file that was there before the engine started is not its own"
    assert names["given"] not in got, "a file of another user is not ours to remove"
    removed, kept = remove_shm_files(got)
    assert names["own"] in removed and not kept
    assert not os.path.exists(names["own"]) and os.path.exists(names["pre"])


def test_a_file_a_live_process_still_maps_is_kept(names):
    with open(names["pre"], "wb") as f:
        f.write(b"p" * 4096)
    before = shm_snapshot()
    eng = _engine(names)
    try:
        got = group_shm_files(eng.pid, before)
    finally:
        eng.kill()
        eng.wait()
    assert names["own"] in got
    with open(names["own"], "r+b") as f, mmap.mmap(f.fileno(), 4096):  # another process of ours uses it now
        removed, kept = remove_shm_files(got)
        assert names["own"] in kept and names["own"] not in removed
        assert os.path.exists(names["own"])
    removed, kept = remove_shm_files(got)
    assert names["own"] in removed and not os.path.exists(names["own"])


def test_a_file_replaced_under_the_same_name_is_not_the_engines(names):
    with open(names["pre"], "wb") as f:
        f.write(b"p" * 4096)
    before = shm_snapshot()
    os.unlink(names["pre"])  # removed and made again once the engine runs: a new file, maybe its own
    with open(names["pre"], "wb") as f:
        f.write(b"q" * 4096)
    eng = _engine(names)
    try:
        got = group_shm_files(eng.pid, before)
    finally:
        eng.kill()
        eng.wait()
    assert names["pre"] in got  # same name, another inode: made after the engine started


def test_a_semaphore_the_dead_engine_made_is_recorded_under_its_name_and_removed():
    # An "engine" that makes a semaphore the way vLLM's processes do (multiprocessing's spawn
    # context): /proc shows it under glibc's temporary name, deleted, not as /dev/shm/sem.mp-*.
    before = shm_snapshot()
    eng, path = semaphores.start_holder()
    try:
        assert os.path.exists(path)
        got = group_shm_files(eng.pid, before)
        assert path in got, f"the engine's semaphore was not recorded: {sorted(got)}"
        removed, kept = remove_shm_files({path})  # the engine still maps it: in use, kept
        assert kept == [path] and not removed and os.path.exists(path)
    finally:
        os.killpg(eng.pid, signal.SIGKILL)  # its resource tracker goes with it: nothing unlinks it
        eng.wait()
    assert os.path.exists(path)
    removed, kept = remove_shm_files(got)
    assert path in removed and not os.path.exists(path)


def test_a_mapping_on_another_tmpfs_is_not_ours_whatever_its_inode():
    """An inode number is unique within one filesystem: a process in another mount namespace
    (a container, a test's private /dev/shm) maps files whose inodes collide with ours, and
    such a file must neither keep one of ours alive nor be taken for one."""
    from hsstream.up.shm_cleanup import parse_maps

    ours = os.makedev(0, 0x1A)
    lines = ["7f00-7f10 rw-s 00000000 00:1a 12 /dev/shm/sem.mp-ours\n",
             "7f10-7f20 rw-s 00000000 00:2b 13 /dev/shm/sem.mp-theirs (deleted)\n",
             "7f20-7f30 r--p 00000000 fd:01 14 /usr/lib/libc.so.6\n"]  # fmt: skip
    assert parse_maps(lines, ours) == [(12, "/dev/shm/sem.mp-ours")]
    assert parse_maps(lines, None) == [(12, "/dev/shm/sem.mp-ours"), (13, "/dev/shm/sem.mp-theirs")]
