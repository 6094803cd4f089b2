"""The stream reads a sample's file in parts at once (issue 9: one thread reads tmpfs at
~3.5 GB/s, most of the notice-to-GPU floor). Whatever the split, the bytes are the file's."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from trainer_client import stream as S


@pytest.mark.parametrize("size", [1, 999, 1000, 4001, 10_007])
@pytest.mark.parametrize("threads", [1, 3, 4])
def test_parts_read_at_once_give_the_files_bytes(tmp_path, monkeypatch, size, threads):
    monkeypatch.setattr(S, "READ_PART", 1000)  # several parts for small files
    data = os.urandom(size)
    f = tmp_path / "x.bin"
    f.write_bytes(data)
    buf = bytearray(size + 17)  # a buffer larger than the file (torch's cache hands those out)
    fd = os.open(f, os.O_RDONLY)
    try:
        S.read_parallel(fd, memoryview(buf), size, threads=threads)
    finally:
        os.close(fd)
    assert bytes(buf[:size]) == data and bytes(buf[size:]) == b"\0" * 17


def test_the_parts_run_on_other_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "READ_PART", 1000)
    seen: set[str] = set()
    real = S._pread_into

    def spy(fd, mv, offset):  # noqa: ANN001, ANN202
        seen.add(threading.current_thread().name)
        return real(fd, mv, offset)

    monkeypatch.setattr(S, "_pread_into", spy)
    f = tmp_path / "x.bin"
    f.write_bytes(os.urandom(8000))
    fd = os.open(f, os.O_RDONLY)
    try:
        S.read_parallel(fd, memoryview(bytearray(8000)), 8000, threads=4)
    finally:
        os.close(fd)
    assert threading.current_thread().name in seen and any(n.startswith("hsstream-read") for n in seen)


def test_a_file_shorter_than_its_size_is_an_invalid_sample(tmp_path, monkeypatch):
    """Truncated between the size being taken and the read (or a lying header)."""
    monkeypatch.setattr(S, "READ_PART", 1000)
    f = tmp_path / "x.bin"
    f.write_bytes(os.urandom(3500))
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(S.InvalidSample, match="short read: 3500 of 5000"):
            S.read_parallel(fd, memoryview(bytearray(5000)), 5000, threads=4)
    finally:
        os.close(fd)


def test_the_stream_reader_returns_the_saved_tensors(tmp_path, monkeypatch):
    """Through read_into_buffer (the pinned path's reader), parts and all."""
    from safetensors.torch import save_file

    monkeypatch.setattr(S, "READ_PART", 4096)
    hs = torch.randn(64, 3, 32).to(torch.bfloat16)
    ids = torch.arange(64)
    save_file({"hidden_states": hs, "token_ids": ids}, str(tmp_path / "s.safetensors"))
    out = S.read_into_buffer(tmp_path / "s.safetensors", None, lambda n: torch.empty(n, dtype=torch.uint8))
    assert torch.equal(out["hidden_states"], hs) and torch.equal(out["token_ids"], ids)
