"""The wire format (connector.protocol): decoding is strict, names are safe, checksums are exact."""

from __future__ import annotations

import json
import os

import blake3
import numpy as np
import pytest

from connector import protocol as P

KEY = P.SampleKey(job="job_1-a", epoch=2, index=17)


def _notice(**kw) -> P.Notice:
    base = dict(
        status=P.NoticeStatus.ok,
        request_id="cmpl-abc-0",
        key=KEY,
        attempt=1,
        file="cmpl-abc-0.safetensors",
        num_tokens=37,
        layer_ids=[5, 2, 10],
        num_hidden_layers=12,
        hidden_size=64,
        dtype="bfloat16",
        nbytes=37 * 3 * 64 * 2,
        checksum="ab" * 32,
        model="tiny",
    )
    base.update(kw)
    return P.Notice(**base)


# ------------------------------------------------------------------------------------ notices


def test_notice_round_trip_bytes_and_str():
    n = _notice()
    data = n.encode()
    assert isinstance(data, bytes)
    assert P.Notice.decode(data) == n
    assert P.Notice.decode(data.decode()) == n
    assert json.loads(data)["v"] == P.PROTOCOL_VERSION


def test_error_notice_round_trip():
    n = _notice(status=P.NoticeStatus.error, reason="write failed: boom", file=None, checksum=None, key=None)
    back = P.Notice.decode(n.encode())
    assert back == n
    assert back.status is P.NoticeStatus.error
    assert back.reason == "write failed: boom"


def _obj(**over):
    d = json.loads(_notice().encode())
    d.update(over)
    return d


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(json.dumps(_obj(v=P.PROTOCOL_VERSION + 1)).encode(), id="next"),
        pytest.param(json.dumps(_obj(v=4)).encode(), id="v4"),
        pytest.param(json.dumps(_obj(v=3)).encode(), id="v3"),
        pytest.param(json.dumps(_obj(v=1)).encode(), id="v1"),
        pytest.param(json.dumps(_obj(v=0)).encode(), id="v0"),
        pytest.param(json.dumps(_obj(v="4")).encode(), id="v-string"),
        pytest.param(json.dumps({k: v for k, v in _obj().items() if k != "v"}).encode(), id="missing-v"),
        pytest.param(b"{not json", id="not-json"),
        pytest.param(b"", id="empty"),
        pytest.param(b"\xff\xfe\xfd", id="not-utf8"),
        pytest.param(b"[1, 2]", id="array"),
        pytest.param(b"1", id="number"),
        pytest.param(b'"ok"', id="string"),
        pytest.param(b"null", id="null"),
        pytest.param(json.dumps(_obj(status="maybe")).encode(), id="bad-status"),
        pytest.param(json.dumps(_obj(surprise=1)).encode(), id="extra-field"),
        pytest.param(json.dumps({"v": P.PROTOCOL_VERSION}).encode(), id="missing-required"),
        pytest.param(json.dumps(_obj(key={"job": "../x", "index": 0})).encode(), id="bad-key"),
    ],
)
def test_notice_decode_rejects(data):
    with pytest.raises(P.ProtocolError):
        P.Notice.decode(data)


def test_unsupported_version_message_names_versions():
    with pytest.raises(P.VersionMismatch, match=r"version 6 .*speaks 5"):
        P.Notice.decode(json.dumps(_obj(v=6)))
    with pytest.raises(P.VersionMismatch, match=r"version 4 .*speaks 5"):
        P.Notice.decode(json.dumps(_obj(v=4)))


def test_notice_is_immutable():
    n = _notice()
    with pytest.raises(Exception):
        n.num_tokens = 1  # type: ignore[misc]


# ------------------------------------------------------------------------- trainer messages


def _one_of_each() -> list:
    return [
        P.Hello(jobs=["a", "b"], follow=True, same_host=False),
        P.Hello(),
        P.Credit(n=5),
        P.Deliver(notice=_notice(), expected_token_ids=[1, 2, 3], loss_mask=[0, 1, 1], label="user-7", lease_s=12.5),
        P.Received(keys=[KEY, P.SampleKey(job="j", index=0)]),
        P.Ack(keys=[KEY]),
        P.Fail(key=KEY, reason="token ids differ"),
        P.Heartbeat(),
        P.End(jobs=["a"], reason="cancelled"),
    ]


def test_every_message_type_is_covered_here():
    assert {P._TYPE_OF[type(m)] for m in _one_of_each()} == set(P.MsgType)


@pytest.mark.parametrize("msg", _one_of_each(), ids=lambda m: type(m).__name__)
def test_msg_round_trip(msg):
    frames = P.encode_msg(msg)
    assert len(frames) == 2 and all(isinstance(f, bytes) for f in frames)
    assert frames[0] == P._TYPE_OF[type(msg)].value.encode()
    back = P.decode_msg(frames)
    assert type(back) is type(msg)
    assert back == msg


@pytest.mark.parametrize("mtype", [b"BOGUS", b"", b"hello", b"\xff\xfe"])
def test_decode_msg_rejects_unknown_type(mtype):
    with pytest.raises(P.ProtocolError):
        P.decode_msg([mtype, P.Heartbeat().model_dump_json().encode()])


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_decode_msg_rejects_wrong_frame_count(n):
    frames = P.encode_msg(P.Credit(n=1))
    frames = (frames + [b"{}"] * 4)[:n]
    with pytest.raises(P.ProtocolError, match="frames|payload"):
        P.decode_msg(frames)


def test_only_deliver_carries_a_payload():
    n = P.Notice(status=P.NoticeStatus.ok, request_id="r", key=P.SampleKey(job="j", index=0), file="r.safetensors")
    frames = P.encode_msg(P.Deliver(notice=n), b"file bytes")
    assert P.payload_of(frames) == b"file bytes" and isinstance(P.decode_msg(frames), P.Deliver)
    with pytest.raises(P.ProtocolError):
        P.encode_msg(P.Credit(n=1), b"x")


def test_decode_msg_rejects_body_of_another_type():
    # A CREDIT frame carrying a HELLO body must not be coerced into a Credit.
    with pytest.raises(P.ProtocolError):
        P.decode_msg([b"CREDIT", P.Hello(jobs=["a"]).model_dump_json().encode()])


def test_decode_msg_checks_version_and_values():
    with pytest.raises(P.VersionMismatch):
        P.decode_msg([b"CREDIT", b'{"v": 1, "n": 1}'])
    with pytest.raises(P.ProtocolError):
        P.decode_msg([b"CREDIT", b'{"n": 1}'])
    with pytest.raises(P.ProtocolError):
        P.decode_msg([b"CREDIT", f'{{"v": {P.PROTOCOL_VERSION}, "n": -1}}'.encode()])
    with pytest.raises(P.VersionMismatch):
        P.decode_msg([b"CREDIT", b'{"v": 2, "n": 1}'])  # the previous release's
    with pytest.raises(P.ProtocolError):
        P.decode_msg([b"ACK", b"not json"])


def test_encode_msg_refuses_non_message():
    # A Notice is not a trainer message: encoding it must fail, not invent a type frame.
    with pytest.raises((KeyError, P.ProtocolError)):
        P.encode_msg(_notice())


# ------------------------------------------------------------------------------ sample keys


@pytest.mark.parametrize(
    "key",
    [KEY, P.SampleKey(job="j", index=0), P.SampleKey(job="A" * 64, epoch=10**6, index=2**40)],
)
def test_sample_key_str_parse_round_trip(key):
    s = str(key)
    assert s == f"{key.job}/{key.epoch}/{key.index}"
    assert P.SampleKey.parse(s) == key


@pytest.mark.parametrize(
    "text",
    ["", "job", "job/1", "job/0/1/2", "/0/1", "job/x/1", "job/0/y", "job/-1/0", "job/0/-3",
     "bad job/0/0", "a.b/0/0", "../0/0", "A" * 65 + "/0/0", "job//1"],
)
def test_sample_key_parse_rejects(text):
    with pytest.raises(P.ProtocolError):
        P.SampleKey.parse(text)


# ------------------------------------------------------------------------------ spool paths


def test_resolve_accepts_plain_file(spool):
    (spool / "cmpl-1.safetensors").write_bytes(b"x")
    p = P.resolve_in_spool(spool, "cmpl-1.safetensors")
    assert p == spool.resolve() / "cmpl-1.safetensors"
    assert p.read_bytes() == b"x"


@pytest.mark.parametrize(
    "name",
    ["../x.safetensors", "..", "a/../b.safetensors", "x/../../x.safetensors", "sub/x.safetensors",
     "/etc/passwd", "/tmp/x.safetensors", ".hidden.safetensors", ".x.safetensors.123.tmp",
     "x.txt", "x.safetensors.tmp", "", "a..b.safetensors", "-x.safetensors", "x\\y.safetensors",
     "x\x00.safetensors", "é.safetensors", "a" * 250 + ".safetensors"],
)
def test_resolve_refuses_unsafe_names(spool, name):
    with pytest.raises(P.UnsafePathError):
        P.resolve_in_spool(spool, name, must_exist=False)
    with pytest.raises(P.UnsafePathError):
        P.resolve_in_spool(spool, name)


def test_resolve_refuses_non_string(spool):
    with pytest.raises(P.UnsafePathError):
        P.resolve_in_spool(spool, None)  # type: ignore[arg-type]


def test_resolve_refuses_symlink_pointing_outside(spool, tmp_path):
    secret = tmp_path / "outside.safetensors"
    secret.write_bytes(b"secret")
    os.symlink(secret, spool / "evil.safetensors")
    with pytest.raises(P.UnsafePathError, match="regular file"):
        P.resolve_in_spool(spool, "evil.safetensors")
    assert secret.read_bytes() == b"secret"


def test_resolve_refuses_symlink_pointing_inside(spool):
    (spool / "real.safetensors").write_bytes(b"x")
    os.symlink(spool / "real.safetensors", spool / "alias.safetensors")
    with pytest.raises(P.UnsafePathError):
        P.resolve_in_spool(spool, "alias.safetensors")


def test_resolve_refuses_directory(spool):
    (spool / "d.safetensors").mkdir()
    with pytest.raises(P.UnsafePathError):
        P.resolve_in_spool(spool, "d.safetensors")


def test_resolve_missing_file(spool):
    with pytest.raises(FileNotFoundError):
        P.resolve_in_spool(spool, "gone.safetensors")
    assert P.resolve_in_spool(spool, "gone.safetensors", must_exist=False) == spool.resolve() / "gone.safetensors"


def test_resolve_refuses_trailing_newline(spool):
    with pytest.raises(P.UnsafePathError):
        P.resolve_in_spool(spool, "x.safetensors\n", must_exist=False)


@pytest.mark.parametrize(
    "rid",
    ["cmpl-0123abc-0", "a/b/c", "../../etc/passwd", "..", ".hidden", "-rf", "--", "", "_x", "a.b.c",
     "日本語-é", "a\x00b", " ", "\n", "x" * 1000, "/abs/path", "chatcmpl-3f2a/../0"],
)
def test_file_name_for_request_is_safe(spool, rid):
    name = P.file_name_for_request(rid)
    assert name.endswith(P.FILE_SUFFIX)
    assert "/" not in name and not name.startswith((".", "-"))
    assert len(name.encode()) <= 255
    assert name == P.file_name_for_request(rid)  # deterministic
    p = P.resolve_in_spool(spool, name, must_exist=False)
    assert p.parent == spool.resolve()
    assert not P.is_tmp_name(name)


def test_file_name_keeps_plain_ids():
    assert P.file_name_for_request("cmpl-abc_1") == "hs-cmpl-abc_1.safetensors"


def test_tmp_name_is_hidden_and_recognised():
    t = P.tmp_name_for("cmpl-1.safetensors")
    assert t.startswith(".") and P.is_tmp_name(t)
    assert not P.is_tmp_name("cmpl-1.safetensors")
    with pytest.raises(P.UnsafePathError):
        P.resolve_in_spool("/nonexistent", t, must_exist=False)


# --------------------------------------------------------------------------------- checksum


def test_checksum_is_blake3_of_concatenation():
    a, b = b"hidden states bytes", bytes(range(256)) * 3
    assert P.checksum(a, b) == blake3.blake3(a + b).hexdigest()
    assert P.checksum(a + b) == P.checksum(a, b)  # split point does not matter
    assert P.checksum() == blake3.blake3(b"").hexdigest()


def test_checksum_of_arrays_uses_raw_bytes():
    hs = np.arange(2 * 3 * 4, dtype=np.uint16).reshape(2, 3, 4)
    ids = np.array([7, 8], dtype=np.int64)
    assert P.checksum(hs, ids) == blake3.blake3(hs.tobytes() + ids.tobytes()).hexdigest()


def test_checksum_changes_with_one_byte():
    data = bytearray(os.urandom(4096))
    before = P.checksum(bytes(data[:1000]), bytes(data[1000:]))
    data[2345] ^= 0x01
    after = P.checksum(bytes(data[:1000]), bytes(data[1000:]))
    assert before != after
    assert len(before) == 64 and int(before, 16) >= 0


def test_expected_nbytes():
    assert P.expected_nbytes(37, 3, 64, P.DTYPE_SIZES["bfloat16"]) == 37 * 3 * 64 * 2


# ---------------------------------------------------------------------- kv_transfer_params


def test_tag_round_trip_through_json():
    tag = P.RequestTag(key=KEY, attempt=3)
    params = P.kv_params_for(tag)
    assert set(params) == {P.KV_PARAMS_KEY}
    wire = json.loads(json.dumps(params))  # it travels inside an HTTP request body
    assert P.tag_from_kv_params(wire) == tag
    assert P.tag_from_kv_params({**wire, "include_output_tokens": True}) == tag


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": False}])
def test_no_tag_for_plain_requests(params):
    assert P.tag_from_kv_params(params) is None


@pytest.mark.parametrize(
    "bad",
    [
        "job/0/1",
        None,
        [],
        {},
        {"key": "job/0/1"},
        {"key": {"job": "bad/job", "index": 0}},
        {"key": {"job": "j", "index": -1}},
        {"key": {"job": "j", "index": 0}, "attempt": -1},
        {"key": {"job": "j", "index": 0}, "extra": 1},
    ],
)
def test_tag_from_malformed_params(bad):
    with pytest.raises(P.ProtocolError):
        P.tag_from_kv_params({P.KV_PARAMS_KEY: bad})


def test_header_metadata_carries_notice():
    n = _notice()
    meta = P.header_metadata(n)
    assert P.Notice.decode(meta[P.HEADER_NOTICE_KEY]) == n
    assert all(isinstance(v, str) for v in meta.values())
