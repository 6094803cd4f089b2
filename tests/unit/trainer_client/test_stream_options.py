"""``StreamOptions`` beside the keyword arguments: the same settings either way, keywords over
the object, an unknown name refused."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from trainer_client import HiddenStateStream, StreamOptions


def test_keywords_and_the_options_object_give_the_same_stream(tmp_path):
    ep = f"ipc://{tmp_path}/d.sock"
    a = HiddenStateStream(ep, jobs=["j"], credit=3, ack="manual", workers=0, spool_dir=tmp_path)
    b = HiddenStateStream(ep, options=StreamOptions(jobs=["j"], credit=3, ack="manual", workers=0, spool_dir=tmp_path))
    try:
        assert a.options == b.options
        assert (a.jobs, a.credit, a.ack_mode, a.workers, a.spool) == (b.jobs, b.credit, b.ack_mode, b.workers, b.spool)
    finally:
        a.close()
        b.close()


def test_a_keyword_overrides_the_options_object(tmp_path):
    s = HiddenStateStream(f"ipc://{tmp_path}/d.sock", options=StreamOptions(credit=3, workers=0), credit=5)
    try:
        assert s.credit == 5 and s.options.credit == 5 and s.workers == 0
    finally:
        s.close()


def test_an_unknown_keyword_is_refused(tmp_path):
    with pytest.raises(TypeError, match="creditt"):
        HiddenStateStream(f"ipc://{tmp_path}/d.sock", creditt=5)


def test_every_keyword_the_docs_use_is_an_option():
    """docs/trainer.md, docs/multi-host.md and the README pass these by name."""
    names = {f.name for f in dataclasses.fields(StreamOptions)}
    used = {"jobs", "spool_dir", "credit", "ack", "follow", "timeout_s", "curve_server_key", "curve_client_cert",
            "pin_memory", "idle_s", "transport", "dequantize", "workers", "device", "host_buffers", "ordered"}
    assert used <= names
    assert list(inspect.signature(HiddenStateStream).parameters)[:2] == ["endpoint", "options"]
