"""``read_hidden_states``: a file of a plain vLLM request (no sample key), read directly, is
validated as fully as a streamed one; a delivery without a key is still refused by the stream."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from connector import protocol as P  # noqa: E402
from trainer_client import InvalidSample, read_hidden_states  # noqa: E402
from trainer_client.stream import load_and_check  # noqa: E402

from tests.support import sample_files  # noqa: E402

IDS = [7, 8, 9, 10, 11]


@pytest.fixture
def plain_file(spool):
    f = sample_files.write_sample(spool, "cmpl-1.safetensors", plain=True, request_id="cmpl-1", token_ids=IDS,
                                  layer_ids=[2, 5, 12], num_hidden_layers=12, hidden=8)  # fmt: skip
    return f.path, f.hidden_states


def test_plain_file_is_read_and_checked(plain_file):
    path, hs = plain_file
    s = read_hidden_states(path, expected_token_ids=IDS)
    assert s.key is None and s.token_ids.tolist() == IDS and torch.equal(s.hidden_states, hs)
    assert s.layer_ids == [2, 5, 12] and torch.equal(s.last_hidden_state, hs[:, 2])
    assert path.exists()  # reading is not consuming: the caller deletes


def _rewrite(path, **change):
    t = load_file(path)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    t.update(change.pop("tensors", {}))
    save_file(t, str(path), metadata=change.pop("metadata", meta))


@pytest.mark.parametrize(
    "wrong, message",
    [
        ("flip", "checksum mismatch"),
        ("nan", "checksum mismatch"),  # a NaN written after the checksum: caught before finiteness
        ("rows", "token_ids shape"),
        ("header", "not written by this connector"),
        ("ids", "token ids differ"),
    ],
)
def test_every_check_still_applies_without_a_key(plain_file, wrong, message):
    path, hs = plain_file
    expected = IDS
    if wrong == "flip":
        bad = hs.clone()
        bad[2, 1, 3] += 1
        _rewrite(path, tensors={P.HIDDEN_STATES_KEY: bad})
    elif wrong == "nan":
        bad = hs.clone()
        bad[0, 0, 0] = float("nan")
        _rewrite(path, tensors={P.HIDDEN_STATES_KEY: bad})
    elif wrong == "rows":
        _rewrite(path, tensors={P.TOKEN_IDS_KEY: torch.tensor(IDS[:4])})
    elif wrong == "header":
        _rewrite(path, metadata={"format": "pt"})
    elif wrong == "ids":
        expected = IDS[::-1]
    with pytest.raises(InvalidSample, match=message):
        read_hidden_states(path, expected_token_ids=expected)


def test_stream_deliveries_still_need_a_key(plain_file):
    path, _ = plain_file
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        n = P.Notice.decode(f.metadata()[P.HEADER_NOTICE_KEY])
    with pytest.raises(InvalidSample, match="without a file or key"):
        load_and_check(path.parent, P.Deliver(notice=n))


def test_missing_and_unreadable_files(spool):
    with pytest.raises(FileNotFoundError):
        read_hidden_states(spool / "gone.safetensors")
    (spool / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InvalidSample, match="not a readable safetensors file"):
        read_hidden_states(spool / "junk.safetensors")
