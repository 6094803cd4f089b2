"""hsstream.numa_calls under a real seccomp filter that refuses what Docker's default profile refuses.

Each case runs in a child process that installs the filter (irreversible) and then probes;
`make compose-smoke` sees the same line in the vllm-cpu container's log.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from hsstream import numa_calls

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="probed on x86-64 and aarch64 only")

CHILD = textwrap.dedent("""
    import ctypes, platform, sys
    from hsstream import numa_calls
    names = sys.argv[1].split(",") if sys.argv[1] else []
    mbind, set_mempolicy, migrate_pages = numa_calls._SYSCALLS[platform.machine()]
    nrs = [{"mbind": mbind, "set_mempolicy": set_mempolicy, "migrate_pages": migrate_pages}[n] for n in names]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
    ERRNO_EPERM, ALLOW = 0x00050000 | 1, 0x7FFF0000
    insns = [Filter(LD_W_ABS, 0, 0, 0)]  # seccomp_data.nr
    for i, nr in enumerate(nrs):  # each refused number jumps to the ERRNO return at the end
        insns.append(Filter(JEQ_K, len(nrs) - i, 0, nr))
    insns += [Filter(RET_K, 0, 0, ALLOW), Filter(RET_K, 0, 0, ERRNO_EPERM)]
    arr = (Filter * len(insns))(*insns)
    prog = Prog(len(insns), arr)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER
    print(",".join(numa_calls.refused()))
""")


def probe_under(refused: list[str]) -> list[str]:
    p = subprocess.run([sys.executable, "-c", CHILD, ",".join(refused)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout.strip()
    return out.split(",") if out else []


def test_nothing_is_refused_without_a_filter():
    assert probe_under([]) == []
    assert numa_calls.explain([]) is None


@pytest.mark.parametrize("refused", [["migrate_pages"], ["mbind", "set_mempolicy", "migrate_pages"]],
                         ids=["default-profile-with-SYS_NICE", "default-profile"])
def test_each_call_the_filter_refuses_is_found(refused):
    assert sorted(probe_under(refused)) == sorted(refused)


def test_the_line_names_the_calls_and_says_threads_stay_bound():
    line = numa_calls.explain(["migrate_pages"])
    assert line.startswith(numa_calls.LINE_PREFIX) and "migrate_pages" in line and "CAP_SYS_NICE" not in line
    assert "binds its threads to their cores" in line and "docs/deploy.md" in line
    line = numa_calls.explain(["mbind", "set_mempolicy", "migrate_pages"])
    assert "CAP_SYS_NICE" in line and "bind their memory" in line
