"""The stream's own safetensors header parser (pinned buffers, a transport's reused buffer)
refuses every malformed header as an invalid sample (InvalidSample: FAIL, produced again),
never with another exception that would stop the trainer at each redelivery. A property test
mutates a real sample file (the connector's writer) at random, in its bytes and in its header's
JSON; targeted cases name each kind of bad header."""

from __future__ import annotations

import json
import os

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector import protocol as P
from connector.contract.sample_file import MAX_HEADER_BYTES
from connector.spool_writer import ShapeInfo, SpoolWriter, WriteJob
from trainer_client import HiddenStateStream
from trainer_client import stream as S
from trainer_client.stream import InvalidSample, load_and_check

IDS = [5, 6, 7, 8]


def _alloc(n: int) -> torch.Tensor:  # what the pinned path allocates, unpinned here (no CUDA needed)
    return torch.empty(n, dtype=torch.uint8)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A real sample file's bytes and its delivery (what the sidecar would send)."""
    spool = tmp_path_factory.mktemp("spool")
    key = P.SampleKey(job="j", index=0)
    w = SpoolWriter(spool, None, ShapeInfo([1, 3], 4, 8, "bfloat16", "m"), num_threads=1)
    hs = torch.randn((len(IDS), 2, 8)).to(torch.bfloat16)
    w.submit(WriteJob("r", "hs-r.safetensors", P.RequestTag(key=key), IDS, hs))
    assert w.flush(5)
    w.close()
    raw = (spool / "hs-r.safetensors").read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    notice = P.Notice.decode(json.loads(raw[8 : 8 + hlen])["__metadata__"][P.HEADER_NOTICE_KEY])
    return raw, P.Deliver(notice=notice, expected_token_ids=IDS)


def _split(raw: bytes) -> tuple[dict, bytes]:
    hlen = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + hlen]), raw[8 + hlen :]


def _join(header: object, data: bytes, *, raw_header: bytes | None = None) -> bytes:
    """A file of that header and data, the header padded with spaces to 8 bytes as safetensors'
    writer does (so the data stays aligned and the checks reach the header's content)."""
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + data


def _every_reader(d: P.Deliver, data: bytes, tmp_path) -> list:
    """The sample through each way the stream reads one: our parser on a transport's buffer
    (memoryview) and on a file into a pinned-style buffer, safetensors' on bytes and on a file."""
    path = tmp_path / "hs-x.safetensors"
    path.write_bytes(data)
    dd = d.model_copy(update={"notice": d.notice.model_copy(update={"file": path.name})})
    out = []
    for how in ("view", "file-pinned", "bytes", "file"):
        try:
            if how == "view":
                out.append(load_and_check(None, d, memoryview(data)))
            elif how == "file-pinned":
                out.append(load_and_check(tmp_path, dd, pin_memory=True, alloc=_alloc))
            elif how == "bytes":
                out.append(load_and_check(None, d, data))
            else:
                out.append(load_and_check(tmp_path, dd))
        except InvalidSample as e:
            out.append(e)
    return out


def test_the_real_file_is_read_by_every_path(real, tmp_path):
    raw, d = real
    got = _every_reader(d, raw, tmp_path)
    assert all(isinstance(g, S.Sample) and g.token_ids.tolist() == IDS for g in got), got


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def _header_edit(draw):
    """One change to the header's JSON, as a function of the header: a field set to any JSON
    value, or edits of the real values that keep them plausible enough to pass the byte count
    and reach the deeper checks (signs of dimensions flipped in pairs, offsets shifted, a value
    nested deep)."""
    name = draw(st.sampled_from([P.HIDDEN_STATES_KEY, P.TOKEN_IDS_KEY, "__metadata__", "extra"]))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "other"]))
    kind = draw(st.sampled_from(["set", "signs", "shift", "nest"]))

    def entry(h: dict) -> dict:
        if not isinstance(h.get(name), dict):
            h[name] = {}
        return h[name]

    if kind == "set":
        value = draw(st.one_of(
            _json, st.lists(st.integers(-(2**66), 2**66), max_size=4),
            st.sampled_from(["BF16", "F16", "F32", "I64", "I32", "F8_E4M3", "F64", "U8", "bf16", ""]),
        ))  # fmt: skip
        return lambda h: entry(h).__setitem__(field, value)
    if kind == "signs":
        flips = draw(st.lists(st.booleans(), min_size=4, max_size=4))
        extra = draw(st.lists(st.sampled_from([1, -1, 0, 2**64]), max_size=2))

        def signs(h: dict) -> None:
            e = entry(h)
            dims = e.get("shape") if isinstance(e.get("shape"), list) else []
            e["shape"] = [-d if f and isinstance(d, int) else d for d, f in zip(dims, flips, strict=False)] + extra

        return signs
    if kind == "shift":
        da, db = draw(st.integers(-96, 96)), draw(st.integers(-96, 96))

        def shift(h: dict) -> None:
            e = entry(h)
            o = e.get("data_offsets")
            if isinstance(o, list) and len(o) == 2 and all(type(x) is int for x in o):
                e["data_offsets"] = [o[0] + da, o[1] + db]

        return shift
    depth = draw(st.integers(1, 100_000))
    return lambda h: _nest(h, name, field, depth)


def _nest(h: dict, name: str, field: str, depth: int) -> None:
    """Mark a value to be written nested ``depth`` lists deep (json.dumps would recurse too)."""
    h.setdefault("__nest__", []).append((name, field, depth))


def _dump(header: dict) -> bytes:
    """The header as JSON, with the values :func:`_nest` marked written in as deep lists."""
    nests = header.pop("__nest__", [])
    for i, (name, field, _) in enumerate(nests):
        if not isinstance(header.get(name), dict):
            header[name] = {}
        header[name][field] = f"@@nest{i}@@"
    text = json.dumps(header)
    for i, (_, _, depth) in enumerate(nests):
        text = text.replace(f'"@@nest{i}@@"', "[" * depth + "]" * depth)
    return text.encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(_header_edit(), min_size=1, max_size=3))
def test_header_json_mutations_are_refused_or_parsed_never_a_crash(real, tmp_path, edits):
    raw, d = real
    header, data = _split(raw)
    for edit in edits:
        edit(header)
    for got in _every_reader(d, _join(None, data, raw_header=_dump(header)), tmp_path):
        assert isinstance(got, S.Sample | InvalidSample), got


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_byte_mutations_are_refused_or_parsed_never_a_crash(real, tmp_path, data):
    raw, d = real
    hlen = int.from_bytes(raw[:8], "little")
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["set", "cut", "insert", "length"]))
        pos = data.draw(st.integers(0, min(len(b), 8 + hlen + 16)))  # mostly the header
        if kind == "set" and pos < len(b):
            b[pos] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del b[pos : pos + data.draw(st.integers(1, 64))]
        elif kind == "insert":
            b[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "length":
            b[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    for got in _every_reader(d, bytes(b), tmp_path):
        assert isinstance(got, S.Sample | InvalidSample), got


def _hs(header: dict) -> dict:
    return header[P.HIDDEN_STATES_KEY]


CASES = {
    "negative dimension": lambda h: _hs(h).update(shape=[-4, -2, 8]),
    "overflowing dimension": lambda h: _hs(h).update(shape=[0, 2**64, 8]),
    "a bool for a dimension": lambda h: _hs(h).update(shape=[True, 2, 8]),
    "a float for a dimension": lambda h: _hs(h).update(shape=[4.0, 2, 8]),
    "offsets past the end": lambda h: _hs(h).update(data_offsets=[0, 10**9]),
    "negative offsets": lambda h: _hs(h).update(data_offsets=[-8, _hs(h)["data_offsets"][1] - 8]),
    "overlapping offsets": lambda h: h[P.TOKEN_IDS_KEY].update(
        data_offsets=[_hs(h)["data_offsets"][1] - 8, _hs(h)["data_offsets"][1] - 8 + 32]),
    "three offsets": lambda h: _hs(h).update(data_offsets=[0, 64, 128]),
    "unknown dtype": lambda h: _hs(h).update(dtype="F64"),
    "a list for a dtype": lambda h: _hs(h).update(dtype=["BF16"]),
    "a tensor entry that is a list": lambda h: h.update({P.HIDDEN_STATES_KEY: [1, 2]}),
    "metadata not a string map": lambda h: h.update(__metadata__={"a": {"b": 1}}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_bad_header_is_an_invalid_sample(real, tmp_path, case):
    raw, d = real
    header, data = _split(raw)
    CASES[case](header)
    for got in _every_reader(d, _join(header, data), tmp_path):
        assert isinstance(got, InvalidSample), (case, got)


@pytest.mark.parametrize("depth", [500, 900, 950, 980, 990, 995, 1000, 1100])
def test_nesting_at_the_edge_of_the_recursion_limit_is_an_invalid_sample(real, tmp_path, depth):
    """Deep enough to parse, or just too deep: a value Python can hold but hardly print."""
    raw, d = real
    header, data = _split(raw)
    header[P.HIDDEN_STATES_KEY]["shape"] = "@@"
    blob = _join(None, data, raw_header=json.dumps(header).encode().replace(b'"@@"', b"[" * depth + b"]" * depth))
    for got in _every_reader(d, blob, tmp_path):
        assert isinstance(got, InvalidSample), (depth, got)


@pytest.mark.parametrize("case", ["deep nesting", "non-UTF-8", "huge length", "a huge header in the file",
                                  "not an object", "holes between tensors"])  # fmt: skip
def test_each_bad_header_in_bytes_is_an_invalid_sample(real, tmp_path, case):
    raw, d = real
    header, data = _split(raw)
    if case == "deep nesting":
        blob = _join(None, data, raw_header=b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    elif case == "non-UTF-8":
        blob = _join(None, data, raw_header=json.dumps(header).encode().replace(b'"BF16"', b'"\xff\xfe"'))
    elif case == "huge length":
        blob = (2**63 + 5).to_bytes(8, "little") + raw[8:]
    elif case == "a huge header in the file":
        header["__metadata__"]["pad"] = "x" * (MAX_HEADER_BYTES + 1)
        blob = _join(header, data)
    elif case == "not an object":
        blob = _join([1, 2], data)
    else:
        blob = _join(header, data + b"\0" * 64)  # bytes no tensor covers (safetensors refuses them too)
    for got in _every_reader(d, blob, tmp_path):
        assert isinstance(got, InvalidSample), (case, got)


def test_the_stream_reports_a_bad_header_failed_and_goes_on(real, tmp_path):
    """Through the stream: FAIL for the bad header (an attempt spent, as for any invalid
    sample), and nothing raised."""
    raw, d = real
    header, data = _split(raw)
    _hs(header)["shape"] = [-4, -2, 8]
    spool = tmp_path / "spool"
    P.claim_spool(spool)
    (spool / "hs-r.safetensors").write_bytes(_join(header, data))
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    ep = f"ipc://{tmp_path}/d.sock"
    sock.bind(ep)
    try:
        s = HiddenStateStream(ep, spool_dir=spool, timeout_s=5, pin_memory=True, workers=0)
        s.host_buffers.alloc = _alloc  # no CUDA here: the pinned path's parser on plain memory
        s._connect()
        assert s._take(d) is None and s.stats["invalid"] == 1
        s.close()
        msgs = []
        while sock.poll(300):
            msgs.append(P.decode_msg(sock.recv_multipart()[1:]))
        (fail,) = [m for m in msgs if isinstance(m, P.Fail)]
        assert not fail.not_received and "shape" in fail.reason
    finally:
        sock.close(linger=0)
    assert os.path.exists(spool / "hs-r.safetensors")  # the sidecar deletes an invalid sample's file
