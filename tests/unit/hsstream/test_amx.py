"""The AMX tile permission: requested where the CPU has AMX, reported as not needed where it
has none, failures reported with their errno; and the vLLM plug-in does it in each process.

The branch for this host's CPU also runs for real in tests/integration/server/test_engine_limits.py
(in every vLLM process of a real engine). The real ``arch_prctl`` is exercised here too:
ARCH_GET_XCOMP_PERM always, and ARCH_REQ_XCOMP_PERM as a real request (granted on an AMX
host, refused by the kernel with an errno elsewhere).
"""

from __future__ import annotations

import ctypes
import errno
import logging

import pytest

from hsstream import amx, vllm_cpu_fix

AMX_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n"
PLAIN_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"


class FakeSyscall:
    def __init__(self, rc: int = 0, err: int = 0) -> None:
        self.calls: list[tuple[int, ...]] = []
        self.rc, self.err = rc, err

    def __call__(self, *args) -> int:  # noqa: ANN002
        self.calls.append(tuple(a.value for a in args))
        ctypes.set_errno(self.err)
        return self.rc


def test_flags_are_read_from_cpuinfo():
    assert amx.has_amx(amx.cpu_flags(AMX_CPUINFO))
    assert not amx.has_amx(amx.cpu_flags(PLAIN_CPUINFO))
    assert amx.cpu_flags("no flags line") == set()


def test_amx_cpu_gets_the_xtiledata_request():
    sc = FakeSyscall()
    r = amx.request_amx_permission(cpuinfo=AMX_CPUINFO, syscall=sc, machine="x86_64")
    assert sc.calls == [(158, 0x1023, 18)]  # syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    assert r.outcome == "requested" and r.line().startswith("hsstream: AMX tile permission requested")


def test_cpu_without_amx_is_not_needed_and_makes_no_call():
    sc = FakeSyscall()
    r = amx.request_amx_permission(cpuinfo=PLAIN_CPUINFO, syscall=sc, machine="x86_64")
    assert sc.calls == [] and r.outcome == "not needed" and "no AMX" in r.detail
    r = amx.request_amx_permission(cpuinfo=AMX_CPUINFO, syscall=sc, machine="aarch64")
    assert sc.calls == [] and r.outcome == "not needed" and "aarch64" in r.detail


def test_refusal_is_reported_with_its_errno():
    r = amx.request_amx_permission(cpuinfo=AMX_CPUINFO, syscall=FakeSyscall(-1, errno.EPERM), machine="x86_64")
    assert r.outcome == "failed" and "errno 1 (EPERM" in r.detail


def test_switch_off(monkeypatch):
    monkeypatch.setenv(amx.ENV_SWITCH, "0")
    sc = FakeSyscall()
    assert amx.request_amx_permission(cpuinfo=AMX_CPUINFO, syscall=sc).outcome == "not needed" and not sc.calls


@pytest.mark.skipif(amx.platform.machine() != "x86_64", reason="arch_prctl is x86-64 only")
def test_the_real_syscall():
    before = amx.granted_features()  # real ARCH_GET_XCOMP_PERM (Linux >= 5.16; None before)
    assert before is None or before & 0b11 == 0b11  # x87 and SSE are always permitted
    # A real ARCH_REQ_XCOMP_PERM, whatever this CPU is: the AMX branch, with the real kernel.
    r = amx.request_amx_permission(cpuinfo=AMX_CPUINFO)
    if amx.has_amx(amx.cpu_flags()):
        assert r.outcome == "requested" and amx.granted_features() & (1 << amx.XFEATURE_XTILEDATA)
    else:  # the kernel refuses tile data on a CPU without it, and we say so with the errno
        assert r.outcome == "failed" and "errno" in r.detail
        assert before is None or not amx.granted_features() & (1 << amx.XFEATURE_XTILEDATA)


def test_reported_once_per_process_even_without_vllm_logging(capsys, monkeypatch):
    """vLLM's API server loads plug-ins before it sets up logging: the line must still show."""
    monkeypatch.setattr(amx.log, "hasHandlers", lambda: False)
    r = amx.request_and_log(cpuinfo=PLAIN_CPUINFO)
    assert capsys.readouterr().err.strip() == r.line()


def test_the_vllm_plugin_requests_it_on_an_amx_cpu(monkeypatch, caplog):
    pytest.importorskip("vllm")
    if not vllm_cpu_fix.is_cpu_build():
        pytest.skip("the plug-in requests AMX only on vLLM's CPU build")
    sc, real_flags = FakeSyscall(), amx.cpu_flags
    monkeypatch.setattr(amx, "cpu_flags", lambda cpuinfo=None: real_flags(AMX_CPUINFO))
    monkeypatch.setattr(amx, "_libc_syscall", lambda: sc)
    monkeypatch.setattr(amx.platform, "machine", lambda: "x86_64")
    with caplog.at_level(logging.INFO, logger=amx.log.name):
        vllm_cpu_fix.register()
    assert sc.calls == [(158, 0x1023, 18)]
    assert f"{amx.LOG_PREFIX} requested" in caplog.text
