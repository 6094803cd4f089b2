"""The wire format: the only module that knows how samples look on the wire and on disk.

The connector (inside vLLM), the sidecar and the trainer client all import this module and
nothing else of each other, so a change of format is a change here plus a version bump.
It must stay importable without vLLM, FastAPI or torch: trainers install without them.

Three things are defined here:

* the *sample key* the sidecar assigns and passes to vLLM in ``kv_transfer_params``;
* the *notice* the connector pushes to the sidecar once a file is complete (or failed);
* the messages between the sidecar's delivery socket and a trainer.

The safetensors file holds ``hidden_states`` [T, K, H] and ``token_ids`` [T] (the keys of
vLLM's Example connector, so its users can read our files unchanged), plus
``hidden_states_scales`` for an FP8 payload (``connector/payload.py``, the payload dtypes'
contract); our metadata rides in the safetensors header under ``hsstream.notice``.
"""

from __future__ import annotations

import json
import os
import re
import stat
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from connector import payload as _payload

#: Version 2: the lease token (``Deliver.token``, echoed in ACK / RECEIVED / FAIL) and FAIL's
#: optional ``not_received``. Peers of another version are refused (``VersionMismatch``).
PROTOCOL_VERSION = 2
#: Characters a lease token may have on the wire (the sidecar makes 32 hex digits).
TOKEN_MAX = 64

#: Keys inside the safetensors file.
HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"
#: safetensors header-metadata key holding the notice as JSON.
HEADER_NOTICE_KEY = "hsstream.notice"
#: Key under which the sidecar puts the sample identity into vLLM's ``kv_transfer_params``.
KV_PARAMS_KEY = "hsstream"
#: Key of the response's ``kv_transfer_params`` that carries the spool path (as vLLM's
#: Example connector does, so existing clients keep working). In a request's
#: ``kv_transfer_params`` it asks for a custom path (only with ``allow_custom_save_path``).
KV_PARAMS_PATH_KEY = "hidden_states_path"
#: Key of the response's ``kv_transfer_params`` that says why no file will come.
KV_PARAMS_ERROR_KEY = "hidden_states_error"

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
#: Every spool file the connector writes is named ``hs-…`` (``file_name_for_request``): the
#: sidecar, the trainer and ``hsstream up`` delete no other name, whatever a message says.
FILE_PREFIX = "hs-"
#: Created by the sidecar in an empty or new spool directory: proof that the spool is ours.
#: Blind clean-ups (the reaper, ``hsstream up``'s stop) only ever run in a marked spool.
SPOOL_MARKER = ".hsstream-spool"
SPOOL_MODE = 0o700  # token ids are the users' prompts: only our user reads the spool
FILE_MODE = 0o600
#: A file's companion lock, ``<path>.lock`` (vLLM's Example-connector contract since #43805,
#: which its ``load_hidden_states`` and hs-connectors' ``FileTransfer`` wait on): it exists,
#: with an exclusive flock held by the writer, before the path is returned to the client;
#: the flock is released once the file is complete; the reader removes the lock with the file.
LOCK_SUFFIX = ".lock"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}\.safetensors$")


class ProtocolError(ValueError):
    """A message or file that does not follow this protocol; never silently accepted."""


class VersionMismatch(ProtocolError):
    """A message of another protocol version: the peer runs another hsstream release."""

    def __init__(self, version: object) -> None:
        self.version = version
        super().__init__(
            f"unsupported protocol version {version!r} (this build speaks {PROTOCOL_VERSION}): the sidecar, "
            "the vLLM connector and the trainers must run hsstream releases of the same protocol version"
        )


class UnsafePathError(ProtocolError):
    """A name that would reach outside the spool (``..``, absolute, symlink, odd characters)."""


class SpoolNotOurs(ProtocolError):
    """A spool directory we did not create (no marker, not empty): nothing in it is ours to delete."""


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
    busy = "busy"  # the connector had no room to write it: not the sample's fault, try again later


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
    #: ``time.time()`` when the connector published the notice (file complete and renamed).
    #: Additive and optional: benchmarks measure notice-to-trainer latency on one host's clock.
    sent_at: float | None = None
    #: Seconds the connector spent on this sample, per stage (``gather`` on the engine's step,
    #: ``copy_wait`` for the device-to-host copy, ``checksum``, ``write`` incl. rename): cheap
    #: counters that let a benchmark say where time goes without profiling vLLM. The sidecar
    #: adds its own (``TIMING_SIDECAR_IN``, ``TIMING_SIDECAR_QUEUE``) to the copy it delivers.
    timings: dict[str, float] = Field(default_factory=dict)

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
        raise VersionMismatch(v)
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


#: How a delivered sample's bytes reach a trainer (``Hello.transport``; ``connector/transport/``):
#: ``spool`` the trainer reads the file itself (same host), ``zmq`` the bytes ride in the DELIVER,
#: ``mooncake`` the trainer reads them from the producing host with the Mooncake Transfer Engine.
Transport = Literal["spool", "zmq", "mooncake"]
TRANSPORTS: tuple[str, ...] = ("spool", "zmq", "mooncake")


class Hello(_Model):
    v: int = PROTOCOL_VERSION
    jobs: list[str] | None = None  # None: every job
    follow: bool = False  # keep waiting after the jobs complete
    same_host: bool = True  # reads the spool itself; else wants the bytes
    #: None: ``spool`` when ``same_host``, else ``zmq`` (what a stream without the setting wants).
    transport: Transport | None = None

    def wanted_transport(self) -> str:
        return self.transport or ("spool" if self.same_host else "zmq")


class Transfer(_Model):
    """Where a transfer-engine reader finds a sample's bytes on the producing host: the engine's
    session (``host:port`` of its P2P handshake), the registered address and the length. Only
    the bytes travel through the engine; this descriptor rides in the DELIVER."""

    session: str = Field(min_length=3, max_length=300)
    addr: int = Field(gt=0)
    nbytes: int = Field(ge=8)


class Credit(_Model):
    v: int = PROTOCOL_VERSION
    n: int = Field(ge=0)


#: Seconds from ``sent_at`` to the sidecar reading the notice off its socket.
TIMING_SIDECAR_IN = "sidecar_in"
#: Seconds from then to the DELIVER leaving for a trainer: the notice applied and committed,
#: the delivery thread woken, a trainer's credit, the lease committed.
TIMING_SIDECAR_QUEUE = "sidecar_queue"


def stamp_sidecar_queue(n: Notice, now: float) -> Notice:
    """``n`` as delivered at ``now``: with its time in the sidecar (when it has its arrival)."""
    if n.sent_at is None or TIMING_SIDECAR_IN not in n.timings:
        return n
    queued = now - n.sent_at - n.timings[TIMING_SIDECAR_IN]
    return n.model_copy(update={"timings": {**n.timings, TIMING_SIDECAR_QUEUE: round(queued, 6)}})


#: A lease token as it travels: a trainer's, echoed back, is only compared, never trusted.
Token = Annotated[str, Field(max_length=TOKEN_MAX)]


class Deliver(_Model):
    """One sample offered to a trainer, with what the sidecar expects so the client can check.

    ``token``: this lease's secret. Keys are sequential and job ids are no secret, so anyone
    who can reach the socket could name a sample; only the trainer it was delivered to knows
    the token, and an ACK, RECEIVED or FAIL counts only with it."""

    v: int = PROTOCOL_VERSION
    notice: Notice
    token: Token = ""  # "" only for a file read without a sidecar (``read_hidden_states``)
    expected_token_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    label: str | None = None  # the user's own id, if any
    lease_s: float = 60.0
    transfer: Transfer | None = None  # transport "mooncake": where to read the bytes


class Ack(_Model):
    """Samples consumed. ``tokens[i]`` is the lease token of ``keys[i]`` (from its DELIVER); a
    key without its token is ignored by the sidecar."""

    v: int = PROTOCOL_VERSION
    keys: list[SampleKey]
    tokens: list[Token] = Field(default_factory=list)

    def pairs(self) -> list[tuple[SampleKey, str]]:
        return _pairs(self.keys, self.tokens)


class Received(_Model):
    """The bytes are in hand, the file may go; ``tokens`` as in :class:`Ack`."""

    v: int = PROTOCOL_VERSION
    keys: list[SampleKey]
    tokens: list[Token] = Field(default_factory=list)

    def pairs(self) -> list[tuple[SampleKey, str]]:
        return _pairs(self.keys, self.tokens)


def _pairs(keys: list[SampleKey], tokens: list[str]) -> list[tuple[SampleKey, str]]:
    """Each key with its token; a key the list has no token for gets "" (never a valid one)."""
    return [(k, tokens[i] if i < len(tokens) else "") for i, k in enumerate(keys)]


class Fail(_Model):
    """The trainer could not use a delivered sample. ``not_received``: it never had the bytes
    (the file was gone or unreadable in the spool it reads, a race of ours, not a bad sample),
    so the sidecar produces the sample again without counting an attempt; else the sample was
    invalid and the attempt counts. Optional and left out when false, so a plain FAIL is the
    message every sidecar of this version parses."""

    v: int = PROTOCOL_VERSION
    key: SampleKey
    reason: str
    not_received: bool = False
    token: Token = ""  # the lease token of its DELIVER

    @model_serializer(mode="wrap")
    def _omit_default_flag(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if not self.not_received:
            out.pop("not_received", None)
        return out


class Heartbeat(_Model):
    """Both ways, every few seconds (the sidecar sends it bare). From a trainer it repeats the
    HELLO and the trainer's window so a restarted sidecar (which knows no peers) can resume serving it without a new handshake."""

    v: int = PROTOCOL_VERSION
    hello: Hello | None = None
    window: int = 0
    #: Seconds since the stream started iterating, and of them the seconds the loop spent
    #: inside the stream waiting for a sample: the trainer's wait share (waited / alive), so
    #: an operator sees whether training is starved by production (``hsstream top``).
    alive_s: float = Field(default=0.0, ge=0)
    waited_s: float = Field(default=0.0, ge=0)


class End(_Model):
    """The followed jobs are complete (``reason`` "complete"); any other reason is a refusal the
    stream raises, e.g. a transport this sidecar does not offer."""

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
    """A spool file name derived from vLLM's request id (unique per engine), safe as a name,
    and recognisably ours (``FILE_PREFIX``)."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", request_id)[:160] or "request"
    if stem != request_id:  # keep distinct ids distinct after the substitution
        import hashlib

        stem += "-" + hashlib.blake2s(request_id.encode(), digest_size=6).hexdigest()
    return FILE_PREFIX + stem + FILE_SUFFIX


_OWN_NAME = re.compile(r"^hs-[A-Za-z0-9_-]{1,200}\.safetensors$")
_OWN_TMP = re.compile(r"^\.(hs-[A-Za-z0-9_-]{1,200}\.safetensors)\.[0-9]{1,10}\.tmp$")
_OWN_LOCK = re.compile(r"^hs-[A-Za-z0-9_-]{1,200}\.safetensors\.lock$")


def is_own_name(name: str) -> bool:
    """True for a name the connector writes: a spool file, its temporary name or its lock."""
    return isinstance(name, str) and bool(
        _OWN_NAME.fullmatch(name) or _OWN_TMP.fullmatch(name) or _OWN_LOCK.fullmatch(name)
    )


def is_own_lock_name(name: str) -> bool:
    """The companion lock (``LOCK_SUFFIX``) of a spool file the connector writes."""
    return isinstance(name, str) and bool(_OWN_LOCK.fullmatch(name))


def lock_is_free(path: str | os.PathLike[str]) -> bool:
    """True if no writer holds the lock file's flock (the write is done or was abandoned).
    A lock still held belongs to a write in progress and must stay."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops our shared flock


def tmp_name_for(name: str) -> str:
    """Hidden name a file is written under before the atomic rename makes it visible."""
    return f"{TMP_PREFIX}{name}.{os.getpid()}{TMP_SUFFIX}"


def is_tmp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX)


def lock_path_for(path: str | os.PathLike[str]) -> str:
    """The companion lock of a hidden-state file (same directory, ``.lock`` appended)."""
    return os.fspath(path) + LOCK_SUFFIX


def is_lock_name(name: str) -> bool:
    """A spool name that is the companion lock of a hidden-state file."""
    return name.endswith(FILE_SUFFIX + LOCK_SUFFIX) and _SAFE_NAME.fullmatch(name[: -len(LOCK_SUFFIX)]) is not None


def data_name_of_lock(name: str) -> str:
    """The hidden-state file a lock belongs to (the lock's name without ``.lock``)."""
    if not is_lock_name(name):
        raise UnsafePathError(f"{name!r} is not a lock file name")
    return name[: -len(LOCK_SUFFIX)]


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
    """Delete ``name`` from the spool if it is a plain file there with a name the connector
    writes (``is_own_name``), with its companion lock if it has one; never anything else.
    Returns whether the file was removed (already gone, unsafe or not ours: False)."""
    path = _own_file_unlocked(spool, name)
    if path is None:
        return False
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def retire_from_spool(spool: str | os.PathLike[str], name: str | None) -> Path | None:
    """Take ``name`` out of the spool at once, for a slower delete elsewhere: its lock removed,
    the file renamed to a temporary name of ours (``tmp_name_for``), which is returned. Freeing
    a 33.5 MB tmpfs file takes ~4 ms, the rename microseconds; for everyone else the file is
    gone, and if the delete never comes (a killed process) the reaper takes the temporary name
    as it takes a connector's. None: nothing of ours by that name (same rules as
    :func:`remove_from_spool`)."""
    path = _own_file_unlocked(spool, name)
    if path is None:
        return None
    dest = path.with_name(tmp_name_for(path.name))
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return None
    return dest


def _own_file_unlocked(spool: str | os.PathLike[str], name: str | None) -> Path | None:
    """The spool file ``name`` if it is one the connector writes (its companion lock removed
    now, as the file is about to go); None for any other name, an unsafe one or a missing file."""
    if not name or not _OWN_NAME.fullmatch(name):
        return None
    try:
        path = resolve_in_spool(spool, name)
    except (UnsafePathError, FileNotFoundError):
        return None
    _remove_lock_of(path)
    return path


def _remove_lock_of(path: Path) -> None:
    lock = Path(lock_path_for(path))
    try:
        if stat.S_ISREG(os.lstat(lock).st_mode):
            lock.unlink()
    except FileNotFoundError:
        pass


def is_marked_spool(spool: str | os.PathLike[str]) -> bool:
    """True if ``spool`` is a plain directory holding our marker as a plain file."""
    try:
        return stat.S_ISDIR(os.lstat(spool).st_mode) and stat.S_ISREG(os.lstat(Path(spool) / SPOOL_MARKER).st_mode)
    except FileNotFoundError:
        return False


def own_spool_entries(spool: str | os.PathLike[str]) -> list[str]:
    """Names in ``spool`` that are ours to delete: the connector's files and temporary files,
    and only in a marked spool (an unmarked directory may be anything, e.g. a model folder)."""
    if not is_marked_spool(spool):
        return []
    return [e.name for e in os.scandir(spool) if is_own_name(e.name) and e.is_file(follow_symlinks=False)]


def claim_spool(spool: str | os.PathLike[str]) -> bool:
    """Make ``spool`` ours or refuse it: create it (mode 0700) with the marker if missing, mark
    it if empty, accept it if marked; refuse anything else (``SpoolNotOurs``), e.g. a model
    folder, so that no clean-up ever runs in it. Returns True if the marker was created now.

    The spool must be a plain directory (a symlink planted in the world-writable /dev/shm could
    point it elsewhere), belong to this user and not be group- or world-writable."""
    root = Path(spool)
    try:
        root.mkdir(parents=True, mode=SPOOL_MODE)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise SpoolNotOurs(f"spool {root} is not a plain directory (a symlink?): refusing to manage it")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SpoolNotOurs(
            f"spool {root} must belong to this user and not be group- or world-writable "
            f"(owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})"
        )
    if is_marked_spool(root):
        if st.st_mode & 0o077:  # ours (marked, our uid), but made before spools were private
            os.chmod(root, SPOOL_MODE)
        return False
    others = sorted(n for n in os.listdir(root) if n != SPOOL_MARKER)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise SpoolNotOurs(
            f"spool {root} is not empty ({shown}) and has no {SPOOL_MARKER} marker, so it is not a spool "
            "hsstream created; refusing to use it, since the spool's clean-up deletes files. Point "
            "HSSTREAM_SPOOL_DIR at a new or empty directory (hsstream marks it as its own)."
        )
    fd = os.open(root / SPOOL_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write("This directory is an hsstream spool: hsstream deletes the hs-*.safetensors files in it.\n")
    os.chmod(root, SPOOL_MODE)
    return True


def checksum(*buffers: Any, algo: str = CHECKSUM_ALGO, threads: int = 1) -> str:
    """The named checksum over the tensors' raw bytes in the order ``payload.checksum_buffers``
    gives (hidden states, their scales if quantised, then token ids).

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


def expected_nbytes(num_tokens: int, num_layers: int, hidden_size: int, dtype_size: int, scale_bytes: int = 0) -> int:
    """Bytes of a sample's hidden states (and their per-token scales, ``scale_bytes`` each, for a
    quantised payload): what the spool budget reserves before submitting."""
    return num_tokens * (num_layers * hidden_size * dtype_size + scale_bytes)


#: Upper bound of a file's safetensors header (tensor table + our notice as metadata).
HEADER_ALLOWANCE = 4096


def expected_file_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype_size: int,
                        scale_bytes: int = 0) -> int:  # fmt: skip
    """Bytes a sample's file can take on the spool: what admission reserves before submitting,
    so the files that do arrive never exceed the budget."""
    return expected_nbytes(num_tokens, num_layers, hidden_size, dtype_size, scale_bytes) + 8 * num_tokens + HEADER_ALLOWANCE


def header_metadata(notice: Notice) -> dict[str, str]:
    return {HEADER_NOTICE_KEY: notice.model_dump_json(), "format": "pt"}


#: Bytes per stored hidden-state value, by the notice's ``dtype`` (the payload's contract).
DTYPE_SIZES: dict[str, int] = _payload.ELEMENT_SIZES


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

