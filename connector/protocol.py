"""The wire format: the only module that knows how samples look on the wire and on disk.

The connector (inside vLLM), the sidecar and the trainer client all import this module and
nothing else of each other, so a change of format is a change here plus a version bump.
It must stay importable without vLLM, FastAPI or torch: trainers install without them.

Three things are defined here:

* the *sample key* the sidecar assigns and passes to vLLM in ``kv_transfer_params``;
* the *notice* the connector pushes to the sidecar once a file is complete (or failed);
* the messages between the sidecar's delivery socket and a trainer.

The safetensors file holds ``hidden_states`` [T, K, H] and ``token_ids`` [T] (the keys of
vLLM's Example connector, so its users can read our files unchanged); our metadata rides in
the safetensors header under ``hsstream.notice``.
"""

from __future__ import annotations

import json
import os
import re
import stat
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROTOCOL_VERSION = 1

#: Keys inside the safetensors file.
HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"
#: safetensors header-metadata key holding the notice as JSON.
HEADER_NOTICE_KEY = "hsstream.notice"
#: Key under which the sidecar puts the sample identity into vLLM's ``kv_transfer_params``.
KV_PARAMS_KEY = "hsstream"
#: Key of the response's ``kv_transfer_params`` that carries the spool path (as vLLM's
#: Example connector does, so existing clients keep working).
KV_PARAMS_PATH_KEY = "hidden_states_path"

#: Checksum kinds a file's notice may name (``Notice.checksum_algo``). The connector writes
#: the one configured (``HSSTREAM_CHECKSUM``), the reader verifies whichever the notice names.
#: blake3 is the default; "xxh3-128" (xxHash's XXH3, 128 bits) is several times cheaper per
#: byte and enough to catch torn or corrupted files, for hosts where checking must keep up
#: with a GPU (a 1,024-token Qwen3-8B-shape sample is 33.5 MB).
CHECKSUM_ALGOS = ("blake3", "xxh3-128")
CHECKSUM_ALGO = "blake3"
FILE_SUFFIX = ".safetensors"
TMP_PREFIX = "."
TMP_SUFFIX = ".tmp"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}\.safetensors$")


class ProtocolError(ValueError):
    """A message or file that does not follow this protocol; never silently accepted."""


class UnsafePathError(ProtocolError):
    """A name that would reach outside the spool (``..``, absolute, symlink, odd characters)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SampleKey(_Model):
    """Identity of one sample: assigned by the sidecar, never by the user.

    A user's own id is only a label; keys must be unique and safe to use in file names and
    ledgers, which user input is not.
    """

    job: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    index: int = Field(ge=0)
    epoch: int = Field(ge=0, default=0)

    def __str__(self) -> str:
        return f"{self.job}/{self.epoch}/{self.index}"

    @classmethod
    def parse(cls, text: str) -> SampleKey:
        try:
            job, epoch, index = text.split("/")
            return cls(job=job, epoch=int(epoch), index=int(index))
        except (ValueError, ValidationError) as e:
            raise ProtocolError(f"bad sample key {text!r}") from e


class RequestTag(_Model):
    """What the sidecar puts into ``kv_transfer_params[KV_PARAMS_KEY]`` of a completion."""

    key: SampleKey
    attempt: int = Field(ge=0, default=0)


class NoticeStatus(str, Enum):
    ok = "ok"
    error = "error"


class Notice(_Model):
    """Connector → sidecar: one request's hidden states are on the spool (or failed).

    An ``error`` notice exists so that a failed write or an aborted request never leaves a
    sample waiting forever for a file that will not come.
    """

    v: int = PROTOCOL_VERSION
    status: NoticeStatus
    reason: str | None = None
    request_id: str
    key: SampleKey | None = None
    attempt: int = 0
    file: str | None = None
    num_tokens: int = 0
    layer_ids: list[int] = Field(default_factory=list)
    num_hidden_layers: int = 0
    hidden_size: int = 0
    dtype: str = ""
    nbytes: int = 0
    checksum: str | None = None
    checksum_algo: str = CHECKSUM_ALGO
    model: str = ""

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes | str) -> Notice:
        return _decode_versioned(cls, data)


def _decode_versioned(cls: type[_Model], data: bytes | str) -> Any:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError("message is not a JSON object")
    v = obj.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {v!r} (this build speaks {PROTOCOL_VERSION})")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise ProtocolError(f"invalid {cls.__name__}: {e}") from e


# --------------------------------------------------------------------------------------------
# Sidecar <-> trainer (ROUTER on the sidecar, DEALER on the trainer). Each ZeroMQ message is
# two frames: the message type and a JSON body. Credit-based flow control (ZeroMQ Guide,
# ch. 7): the trainer says how many samples it can take; the sidecar never sends more.
# --------------------------------------------------------------------------------------------


class MsgType(str, Enum):
    hello = "HELLO"  # trainer -> sidecar: which jobs it follows
    credit = "CREDIT"  # trainer -> sidecar: room for n more samples
    deliver = "DELIVER"  # sidecar -> trainer: one sample
    received = "RECEIVED"  # trainer -> sidecar: bytes in hand, file may go
    ack = "ACK"  # trainer -> sidecar: samples consumed, never again
    fail = "FAIL"  # trainer -> sidecar: sample invalid
    heartbeat = "HEARTBEAT"  # both ways: still alive
    end = "END"  # sidecar -> trainer: the followed jobs are complete


class Hello(_Model):
    v: int = PROTOCOL_VERSION
    jobs: list[str] | None = None  # None: every job
    follow: bool = False  # keep waiting after the jobs complete
    same_host: bool = True  # reads the spool itself; else wants the bytes


class Credit(_Model):
    v: int = PROTOCOL_VERSION
    n: int = Field(ge=0)


class Deliver(_Model):
    """One sample offered to a trainer, with what the sidecar expects so the client can check."""

    v: int = PROTOCOL_VERSION
    notice: Notice
    expected_token_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    label: str | None = None  # the user's own id, if any
    lease_s: float = 60.0


class Ack(_Model):
    v: int = PROTOCOL_VERSION
    keys: list[SampleKey]


class Received(_Model):
    v: int = PROTOCOL_VERSION
    keys: list[SampleKey]


class Fail(_Model):
    v: int = PROTOCOL_VERSION
    key: SampleKey
    reason: str


class Heartbeat(_Model):
    """Trainer → sidecar, every few seconds. It repeats the HELLO and the trainer's window so a
    restarted sidecar (which knows no peers) can resume serving it without a new handshake."""

    v: int = PROTOCOL_VERSION
    hello: Hello | None = None
    window: int = 0


class End(_Model):
    v: int = PROTOCOL_VERSION
    jobs: list[str] | None = None
    reason: str = "complete"


_BODY: dict[MsgType, type[_Model]] = {
    MsgType.hello: Hello,
    MsgType.credit: Credit,
    MsgType.deliver: Deliver,
    MsgType.received: Received,
    MsgType.ack: Ack,
    MsgType.fail: Fail,
    MsgType.heartbeat: Heartbeat,
    MsgType.end: End,
}
_TYPE_OF = {v: k for k, v in _BODY.items()}


def encode_msg(body: _Model, payload: bytes | memoryview | None = None) -> list:
    """Frames of a message. A DELIVER to a remote trainer carries the whole safetensors file as
    a third frame (the trainer cannot read our /dev/shm); checksum and shapes come with it."""
    frames: list = [_TYPE_OF[type(body)].value.encode(), body.model_dump_json().encode()]
    if payload is not None:
        if not isinstance(body, Deliver):
            raise ProtocolError("only DELIVER carries a payload")
        frames.append(payload)
    return frames


def payload_of(frames: list[bytes]) -> bytes | None:
    return frames[2] if len(frames) == 3 else None


def decode_msg(frames: list[bytes]) -> _Model:
    if len(frames) not in (2, 3):
        raise ProtocolError(f"expected 2 or 3 frames, got {len(frames)}")
    if len(frames) == 3 and frames[0] != MsgType.deliver.value.encode():
        raise ProtocolError("only DELIVER carries a payload frame")
    try:
        mtype = MsgType(frames[0].decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"unknown message type {frames[0][:32]!r}") from e
    return _decode_versioned(_BODY[mtype], frames[1])


# --------------------------------------------------------------------------------------------
# Files in the spool
# --------------------------------------------------------------------------------------------


def file_name_for_request(request_id: str) -> str:
    """A spool file name derived from vLLM's request id (unique per engine), safe as a name."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", request_id)[:160] or "request"
    if not stem[0].isalnum():
        stem = "r" + stem
    if stem != request_id:  # keep distinct ids distinct after the substitution
        import hashlib

        stem += "-" + hashlib.blake2s(request_id.encode(), digest_size=6).hexdigest()
    return stem + FILE_SUFFIX


def tmp_name_for(name: str) -> str:
    """Hidden name a file is written under before the atomic rename makes it visible."""
    return f"{TMP_PREFIX}{name}.{os.getpid()}{TMP_SUFFIX}"


def is_tmp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX)


def resolve_in_spool(spool: str | os.PathLike[str], name: str, *, must_exist: bool = True) -> Path:
    """The path of ``name`` inside ``spool``, or ``UnsafePathError``.

    Every component that reads or deletes a spool file goes through here: a notice or a
    delivery is input from another process, and must never make us touch anything else.
    Only flat, plain names are allowed; a symlink is refused even if it points inside.
    """
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise UnsafePathError(f"refusing spool file name {name!r}: not a plain file name in the spool")
    root = Path(spool).resolve()
    path = root / name
    if path.parent != root:
        raise UnsafePathError(f"refusing {name!r}: outside the spool {root}")
    if must_exist:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"refusing {name!r}: not a regular file (symlink or special)")
    return path


def spool_file_exists(spool: str | os.PathLike[str], name: str | None) -> bool:
    """True if ``name`` is a plain file in the spool; any unsafe or missing name is False."""
    try:
        return name is not None and resolve_in_spool(spool, name).exists()
    except (UnsafePathError, FileNotFoundError):
        return False


def remove_from_spool(spool: str | os.PathLike[str], name: str | None) -> bool:
    """Delete ``name`` from the spool if it is a plain file there; never anything else.
    Returns whether a file was removed (already gone or unsafe: False)."""
    try:
        resolve_in_spool(spool, name or "").unlink()
        return True
    except (UnsafePathError, FileNotFoundError):
        return False


def checksum(*buffers: Any, algo: str = CHECKSUM_ALGO, threads: int = 1) -> str:
    """The named checksum over the tensors' raw bytes in file order (hidden states, then token ids).

    One definition for files on the spool and bytes sent over the network. Both kinds release
    the GIL on large inputs, so checking never stalls the engine or the training loop.
    ``threads`` (blake3 only; 0 = as many as useful) does not change the digest: the writer
    inside vLLM keeps one thread, the trainer, which must keep up with a GPU, uses all.
    """
    if algo == "blake3":
        import blake3

        h = blake3.blake3(max_threads=blake3.blake3.AUTO if threads == 0 else max(1, threads))
    elif algo == "xxh3-128":
        import xxhash

        h = xxhash.xxh3_128()
    else:
        raise ProtocolError(f"unknown checksum algorithm {algo!r} (known: {', '.join(CHECKSUM_ALGOS)})")
    for b in buffers:
        h.update(memoryview(b).cast("B"))
    return h.hexdigest()


def expected_nbytes(num_tokens: int, num_layers: int, hidden_size: int, dtype_size: int) -> int:
    """Bytes of a sample's hidden states: what the spool budget reserves before submitting."""
    return num_tokens * num_layers * hidden_size * dtype_size


#: Upper bound of a file's safetensors header (tensor table + our notice as metadata).
HEADER_ALLOWANCE = 4096


def expected_file_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype_size: int) -> int:
    """Bytes a sample's file can take on the spool: what admission reserves before submitting,
    so the files that do arrive never exceed the budget."""
    return expected_nbytes(num_tokens, num_layers, hidden_size, dtype_size) + 8 * num_tokens + HEADER_ALLOWANCE


def header_metadata(notice: Notice) -> dict[str, str]:
    return {HEADER_NOTICE_KEY: notice.model_dump_json(), "format": "pt"}


DTYPE_SIZES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_params_for(tag: RequestTag) -> dict[str, Any]:
    return {KV_PARAMS_KEY: tag.model_dump(mode="json")}


def tag_from_kv_params(params: dict[str, Any] | None) -> RequestTag | None:
    """The sidecar's tag from a request's ``kv_transfer_params``; None for plain requests."""
    if not params or KV_PARAMS_KEY not in params:
        return None
    try:
        return RequestTag.model_validate(params[KV_PARAMS_KEY])
    except ValidationError as e:
        raise ProtocolError(f"bad {KV_PARAMS_KEY} in kv_transfer_params: {e}") from e

