"""The wire messages and their version: what the connector, the sidecar and the trainers say.

Three kinds, each a pydantic model that refuses what it does not define:

* the *sample key* the sidecar assigns and passes to vLLM in ``kv_transfer_params``
  (:class:`RequestTag`);
* the *notice* the connector pushes to the sidecar once a file is complete (or failed);
* the messages between the sidecar's delivery socket and a trainer (HELLO, CREDIT, DELIVER,
  RECEIVED, ACK, FAIL, HEARTBEAT, END), each two ZeroMQ frames (type, JSON body), a DELIVER to
  a remote trainer with the file as a third.

A change of any of them is a change here plus a bump of :data:`PROTOCOL_VERSION`. Importable
without vLLM, FastAPI or torch: trainers install without them.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from connector.contract.arena import Slot
from connector.contract.errors import ProtocolError
from connector.contract.sample_file import CHECKSUM_ALGO

#: Version 5: the writer's finiteness verdict in the notice (``Notice.finite``).
#: Version 4: a slot of the arena spool layout (``connector/contract/arena.py``) in the sidecar's
#: request tag and in the notice (``RequestTag.slot``, ``Notice.slot``; ``file`` is then None).
#: Version 3: a trainer's HEARTBEAT may carry its training figures (``Heartbeat.train``). Version
#: 2 brought the lease token (``Deliver.token``, echoed in ACK / RECEIVED / FAIL) and FAIL's
#: optional ``not_received``. Peers of another version are refused (``VersionMismatch``).
PROTOCOL_VERSION = 5
#: Characters a lease token may have on the wire (the sidecar makes 32 hex digits).
TOKEN_MAX = 64

#: Key under which the sidecar puts the sample identity into vLLM's ``kv_transfer_params``.
KV_PARAMS_KEY = "hsstream"
#: Key of the response's ``kv_transfer_params`` that carries the spool path (as vLLM's
#: Example connector does, so existing clients keep working). In a request's
#: ``kv_transfer_params`` it asks for a custom path (only with ``allow_custom_save_path``).
KV_PARAMS_PATH_KEY = "hidden_states_path"
#: Key of the response's ``kv_transfer_params`` that says why no file will come.
KV_PARAMS_ERROR_KEY = "hidden_states_error"
#: Key of the response's ``kv_transfer_params`` for a sample of the arena layout: the slot it is
#: written to (``Slot`` as JSON), in place of a ``hidden_states_path`` (no file exists).
KV_PARAMS_SLOT_KEY = "hsstream_slot"


class VersionMismatch(ProtocolError):
    """A message of another protocol version: the peer runs another hsstream release."""

    def __init__(self, version: object) -> None:
        self.version = version
        super().__init__(
            f"unsupported protocol version {version!r} (this build speaks {PROTOCOL_VERSION}): the sidecar, "
            "the vLLM connector and the trainers must run hsstream releases of the same protocol version"
        )


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
    #: The arena layout: where the connector writes this sample (None: a file in the spool).
    slot: Slot | None = None


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
    #: The arena layout: the slot the sample was written to (then ``file`` is None).
    slot: Slot | None = None
    num_tokens: int = 0
    layer_ids: list[int] = Field(default_factory=list)
    num_hidden_layers: int = 0
    hidden_size: int = 0
    dtype: str = ""
    nbytes: int = 0
    checksum: str | None = None
    checksum_algo: str = CHECKSUM_ALGO
    #: The writer's own verdict on the hidden states it hashed: True when every value is finite
    #: (found in the checksum's pass, ``sample_file.checksum_and_finite``), None when it did not
    #: look. A reader whose checksum matches reads the very bytes the writer scanned, so it may
    #: take a True instead of scanning again (the trainer does, unless told to rescan).
    finite: bool | None = None
    model: str = ""
    #: ``time.time()`` when the connector published the notice (file complete and renamed).
    #: Additive and optional: benchmarks measure notice-to-trainer latency on one host's clock.
    sent_at: float | None = None
    #: Seconds the connector spent on this sample, per stage (``gather`` on the engine's step,
    #: ``queue`` for a writer thread, ``copy_wait`` for the device-to-host copy, ``checksum``, ``write`` incl. rename): cheap
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


#: A transport's name as a HELLO carries it (``connector/transport/``: the registry says which
#: exist; a sidecar refuses one it does not offer with an END naming the ones it does).
TransportName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
#: A transport's descriptor in a DELIVER (where the receiver finds the bytes): its shape is the
#: transport's own (e.g. ``connector/transport/mooncake.py``'s ``Transfer``), checked there.
Descriptor = Annotated[dict[str, int | str], Field(max_length=16)]


class Hello(_Model):
    v: int = PROTOCOL_VERSION
    jobs: list[str] | None = None  # None: every job
    follow: bool = False  # keep waiting after the jobs complete
    same_host: bool = True  # reads the spool itself; else wants the bytes
    #: None: ``spool`` when ``same_host``, else ``zmq`` (what a stream without the setting wants).
    transport: TransportName | None = None

    def wanted_transport(self) -> str:
        return self.transport or ("spool" if self.same_host else "zmq")


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
    transfer: Descriptor | None = None  # for a transport that needs one (Mooncake): where the bytes are


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


#: Bounds of a training report's figures: far beyond any real run, so a value past one is a
#: peer's bug or malice, refused with the message rather than shown on a dashboard.
REPORT_MAX_STEP = 10**12
REPORT_MAX_LOSS = 1e6
REPORT_MAX_RATE = 1e9
_Figure = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class TrainReport(_Model):
    """A trainer's latest figures, as its loop told its stream (``HiddenStateStream.report``):
    the step it finished, its loss, and its speed. The sidecar only shows them (``/metrics``,
    the overview), so every field but ``step`` is optional; each is a finite, non-negative
    number below a bound, and anything else refuses the whole HEARTBEAT. Strict: a string or a
    boolean is not a number here."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    step: int = Field(ge=0, le=REPORT_MAX_STEP)
    loss: Annotated[_Figure, Field(le=REPORT_MAX_LOSS)] | None = None
    steps_per_s: Annotated[_Figure, Field(le=REPORT_MAX_RATE)] | None = None
    samples_per_s: Annotated[_Figure, Field(le=REPORT_MAX_RATE)] | None = None


class Heartbeat(_Model):
    """Both ways, every few seconds (the sidecar sends it bare). From a trainer it repeats the
    HELLO and the trainer's window so a restarted sidecar (which knows no peers) can resume serving it without a new handshake."""

    v: int = PROTOCOL_VERSION
    hello: Hello | None = None
    window: int = 0
    #: Seconds since the stream started iterating, and of them the seconds the loop spent
    #: inside the stream waiting for a sample: the trainer's wait share (waited / alive), so
    #: an operator sees whether training is starved by production (``hsstream top``).
    alive_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    waited_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    #: The loop's latest training report, if it gave one; repeated in every heartbeat so a
    #: restarted sidecar has it at the next beat.
    train: TrainReport | None = None


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
# The sidecar's tag in vLLM's kv_transfer_params
# --------------------------------------------------------------------------------------------


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
