"""The stream reads a sample's file in parts at once (issue 9: one thread reads tmpfs at
~3.5 GB/s, most of the notice-to-GPU floor). Whatever the split, the bytes are the file's."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from connector import protocol as P
from trainer_client import sample_reader as S
from trainer_client.sample_checks import load_and_check

from tests.support import sample_files


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
        time.sleep(0.01)  # a part takes a while: no one thread takes them all
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


def test_a_failed_read_returns_only_once_every_reader_is_done(tmp_path, monkeypatch):
    """An I/O error in one part: the caller closes the file and frees the buffer when this
    returns, so no other reader may still be inside its read (it would read a closed or
    reused fd into a buffer handed back)."""
    monkeypatch.setattr(S, "READ_PART", 1000)
    slow_done = threading.Event()

    def pread(fd, mv, offset):  # noqa: ANN001, ANN202
        if offset == 1000:  # one slow part, taken by one helper ...
            time.sleep(0.3)
            slow_done.set()
            return len(mv)
        raise OSError(5, "Input/output error")  # ... while every other part fails at once

    monkeypatch.setattr(S, "_pread_into", pread)
    for _ in range(3):
        slow_done.clear()
        with pytest.raises(OSError, match="Input/output"):
            S.read_parallel(-1, memoryview(bytearray(4000)), 4000, threads=4, feed=lambda a, b: None)
        assert slow_done.is_set(), "read_parallel returned while a reader was still reading"


def test_the_stream_reader_returns_the_saved_tensors(tmp_path, monkeypatch):
    """Through read_into_buffer (the pinned path's reader), parts and all."""
    from safetensors.torch import save_file

    monkeypatch.setattr(S, "READ_PART", 4096)
    hs = torch.randn(64, 3, 32).to(torch.bfloat16)
    ids = torch.arange(64)
    save_file({"hidden_states": hs, "token_ids": ids}, str(tmp_path / "s.safetensors"))
    out = S.read_into_buffer(tmp_path / "s.safetensors", None, lambda n: torch.empty(n, dtype=torch.uint8))
    assert torch.equal(out["hidden_states"], hs) and torch.equal(out["token_ids"], ids)


def test_parts_are_handed_over_in_file_order_while_later_ones_are_still_read(tmp_path, monkeypatch):
    """The copy to a GPU starts on the first parts while the rest are read."""
    monkeypatch.setattr(S, "READ_PART", 1000)
    events: list[tuple] = []
    real = S._pread_into

    def slow(fd, mv, offset):  # noqa: ANN001, ANN202
        time.sleep(0.005)
        got = real(fd, mv, offset)
        events.append(("read", offset))
        return got

    monkeypatch.setattr(S, "_pread_into", slow)
    data = os.urandom(10_500)
    f = tmp_path / "x.bin"
    f.write_bytes(data)
    buf = bytearray(len(data))
    fed: list[tuple[int, int]] = []

    def feed(a: int, b: int) -> None:
        assert bytes(buf[a:b]) == data[a:b]  # a part is handed over only once it is in
        fed.append((a, b))
        events.append(("feed", a))

    fd = os.open(f, os.O_RDONLY)
    try:
        S.read_parallel(fd, memoryview(buf), len(data), threads=2, start=500, feed=feed)
    finally:
        os.close(fd)
    assert fed == [(a, min(a + 1000, len(data))) for a in range(500, len(data), 1000)]  # in order, all of it
    assert events.index(("feed", 500)) < max(i for i, e in enumerate(events) if e[0] == "read")


def _sample(tmp_path, *, flip_at: int | None = None):  # noqa: ANN202
    f = sample_files.write_sample(tmp_path, tokens=64, layer_ids=[1, 2, 3], hidden=32, token_ids=torch.arange(64),
                                  request_id="r")  # fmt: skip
    if flip_at is not None:  # after the digest: one bit in one part
        with safe_open(str(f.path), "pt") as fh:
            meta = fh.metadata()
        tensors = load_file(str(f.path))
        tensors[P.HIDDEN_STATES_KEY].view(-1).view(torch.uint8)[flip_at] ^= 1
        save_file(tensors, str(f.path), metadata=meta)
    return f.hidden_states, f.deliver


def _load(tmp_path, d):  # noqa: ANN001, ANN202
    return load_and_check(tmp_path, d, pin_memory=True, alloc=lambda n: torch.empty(n, dtype=torch.uint8))


@pytest.mark.parametrize("flip_at", [0, 5000, 64 * 3 * 32 * 2 - 1])
def test_a_file_read_in_parts_is_checksummed_whole_a_bit_in_any_part_is_caught(tmp_path, monkeypatch, flip_at):
    monkeypatch.setattr(S, "READ_PART", 1000)
    monkeypatch.setattr(S, "HEAD_BYTES", 512)
    hs, d = _sample(tmp_path)
    assert torch.equal(_load(tmp_path, d).hidden_states, hs)
    _, d = _sample(tmp_path, flip_at=flip_at)
    with pytest.raises(S.InvalidSample, match="checksum mismatch"):
        _load(tmp_path, d)


def test_a_header_that_disagrees_with_the_notice_is_refused_before_any_data_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "READ_PART", 1000)
    monkeypatch.setattr(S, "HEAD_BYTES", 2048)  # the writer's header (its notice included) in one read
    _, d = _sample(tmp_path)
    reads: list[int] = []
    real = S._pread_into
    monkeypatch.setattr(S, "_pread_into", lambda fd, mv, off: reads.append(off) or real(fd, mv, off))
    bad = P.Deliver(notice=d.notice.model_copy(update={"hidden_size": 64}), expected_token_ids=d.expected_token_ids)
    with pytest.raises(S.InvalidSample, match="hidden_states shape"):
        _load(tmp_path, bad)
    assert reads == [0]  # the head only
