"""The sidecar's REST API: every request and response body, as OpenAPI shows it.

One module for both sides: the routes in ``server/routers/`` declare these models as their
``response_model``, and the one client (``connector/contract/rest_client.py``) parses every answer
with the same models, so a field renamed here breaks the client's tests, not a user's run.
Imports pydantic only (a validator loads jinja2 and the chat-template code when it needs them),
so the trainer and the CLI read the contract without FastAPI.

Where a route's JSON has a key only sometimes (``/readyz``'s ``problems``, ``/v1/stats``'s sample
size before it is known), the model leaves it out when unset: the wire stays as it was.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

#: The longest chat template a job may bring (characters). Real ones are 1-20 KB.
MAX_CHAT_TEMPLATE_CHARS = 65536

#: A token id as the ledger stores it (int32) and vLLM takes it; a tokenizer's vocabulary narrows it.
TokenId = Annotated[int, Field(ge=0, lt=2**31, strict=True)]  # strict: no true, "1" or 1.0
#: An integer SQLite and vLLM can hold (int64).
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


def _encodable(v: object, where: str = "sample") -> None:
    """JSON may carry lone surrogates (``"\\ud800"``); no tokenizer, UTF-8 file or SQLite column
    can hold them, so they are refused here, with the place, instead of failing deep inside.
    Likewise NaN and infinities (Python's JSON reads ``NaN``, ``Infinity`` and ``1e400``), which
    no JSON encoder writes back out."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{where}: not a finite number")
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where}: text is not valid Unicode ({e.reason} at position {e.start})") from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _encodable(x, f"{where}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _encodable(x, f"{where}[{i}]")


class ChatMessage(BaseModel):
    """An OpenAI chat message: ``content`` a string, a list of content parts (text parts only
    are extracted) or null (an assistant turn with ``tool_calls``); other keys
    (``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content``, ...) reach the template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[Any] | None = None


class ShareGPTTurn(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    from_: str = Field(alias="from")
    value: str | dict[str, Any] | list[Any]


class SampleIn(BaseModel):
    """One of ``prompt``, ``messages``, ``conversations``, ``token_ids``; a ``prompt`` beside a
    conversation (UltraChat rows) is accepted when it is the conversation's first user turn.
    ``tools`` (OpenAI function specs, or their JSON text) go to the chat template. Other keys
    (a ShareGPT row's ``model``, UltraChat's ``prompt_id``) are ignored, not stored, and
    named in the job's ``warnings``."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    conversations: list[ShareGPTTurn] | None = None
    token_ids: list[TokenId] | None = None
    tools: list[dict[str, Any]] | str | None = None
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _exactly_one(self) -> SampleIn:
        given = [k for k in ("prompt", "messages", "conversations", "token_ids") if getattr(self, k) is not None]
        chat = [k for k in given if k in ("messages", "conversations")]
        if not (len(given) == 1 or (len(given) == 2 and len(chat) == 1 and "prompt" in given)):
            raise ValueError(
                f"a sample needs exactly one of prompt, messages, conversations, token_ids (got {given or 'none'}; "
                "a prompt beside messages or conversations is allowed when it repeats the first user turn)"
            )
        if self.tools is not None and not chat:
            raise ValueError("tools go with a conversation (messages or conversations)")
        self._ignored = sorted(self.__pydantic_extra__ or {})
        self.__pydantic_extra__ = {}  # ignored: neither tokenised nor stored
        _encodable(self.model_dump(exclude={"token_ids"}, by_alias=True))
        return self

    @property
    def ignored_keys(self) -> list[str]:
        """The sample's keys that are none of the above (ignored)."""
        return self._ignored


class SamplingOptions(BaseModel):
    """How vLLM writes the new reply in ``regenerate`` mode (the data's own reply is dropped)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_tokens: int = Field(default=256, ge=2, le=32768)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Int64 | None = Field(
        default=None, description="the replies' seed in the first epoch; each later epoch gets its own, derived "
        "from it (server/submitter.py epoch_seed), so every epoch regenerates a fresh reply; unset: vLLM's random",
    )  # fmt: skip


class JobOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loss_mask: Literal["assistant", "all"] = "assistant"
    max_tokens_per_sample: int | None = Field(default=None, ge=1, lt=2**31)
    overlong: Literal["truncate", "reject"] = "reject"
    on_invalid: Literal["reject", "skip"] = "reject"
    epochs: int = Field(default=1, ge=1, le=1000)
    seed: Int64 = 0
    mode: Literal["extract", "regenerate"] = "extract"
    sampling: SamplingOptions = Field(default_factory=lambda: SamplingOptions())
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="more variables for the chat template, as vLLM's chat_template_kwargs "
        "(e.g. {\"enable_thinking\": false} for Qwen3)",
    )  # fmt: skip
    chat_template: str | None = Field(
        default=None, max_length=MAX_CHAT_TEMPLATE_CHARS,
        description="the job's own chat template (Jinja, rendered in transformers' sandbox, each sample's "
        "renders bounded in time), instead of the verifier tokenizer's",
    )  # fmt: skip

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_are_the_templates(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        from connector.contract.sample_tokens import RESERVED_TEMPLATE_KWARGS

        bad = sorted(set(v or ()) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}: the sidecar sets them")
        if v is not None:
            _encodable(v, "chat_template_kwargs")
        return v

    @field_validator("chat_template")
    @classmethod
    def _template_parses(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("chat_template is empty")
        _encodable(v, "chat_template")
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        from connector.contract.sample_tokens import _generation_ext

        try:
            ImmutableSandboxedEnvironment(extensions=[loopcontrols, _generation_ext()]).parse(v)
        except TemplateSyntaxError as e:
            raise ValueError(f"chat_template is not valid Jinja: {e.message} (line {e.lineno})") from None
        return v


class JobIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: list[SampleIn] = Field(min_length=1)
    options: JobOptions = Field(default_factory=JobOptions)


class JobCreated(BaseModel):
    job_id: str
    num_samples: int
    num_failed_at_submission: int = 0
    warnings: list[str] = Field(
        default_factory=list, description="what was accepted but ignored (a sample key none of the fields), "
        "skipped (on_invalid: skip) or repaired, each once with the number of samples",
    )  # fmt: skip
    skipped: dict[str, int] = Field(
        default_factory=dict, description="records not queued (on_invalid: skip), per reason; with num_samples / "
        "epochs they add up to the records sent",
    )  # fmt: skip
    repaired: dict[str, int] = Field(
        default_factory=dict, description="ShareGPT conversations queued after a repair, per repair "
        "(docs/architecture.md, 'Rows as datasets ship them')",
    )  # fmt: skip


class SampleError(BaseModel):
    index: int
    label: str | None
    errors: list[str]


class JobStatus(BaseModel):
    job_id: str
    done: bool
    counts: dict[str, int]
    num_samples: int
    tokens_consumed: int
    bytes_consumed: int
    elapsed_s: float
    tokens_per_s: float
    errors: list[SampleError]
    errors_total: int
    errors_offset: int
    compacted: bool = False  # finished longer than HSSTREAM_JOB_RETENTION_S ago: counts kept, errors and data gone
    skipped: dict[str, int] = Field(default_factory=dict, description="records skipped at submission, per reason")
    warnings: list[str] = Field(default_factory=list, description="the submission's warnings (JobCreated's)")


class TokenCounts(BaseModel):
    """Token frequencies of a job's data, so a trainer can pick its draft vocabulary before
    step 1. ``counts`` covers loss-masked positions (what the draft learns to predict)."""

    job_id: str
    vocab_size: int | None
    total_tokens: int
    counts: dict[int, int]


class JobSample(BaseModel):
    """One sample of a job as the sidecar keeps it (epoch 0): what an evaluator prompts with."""

    index: int
    id: str | None = Field(description="the row's own id (its label), if it had one")
    token_ids: list[int]
    loss_mask: list[int] | None = Field(description="1 where the draft is trained; None: every position")
    prompt_len: int | None = Field(
        None, description="regenerate jobs: token_ids beyond this many are vLLM's reply (None: not such a job)")


class JobSamples(BaseModel):
    """A page of a job's samples, in index order (``GET /v1/jobs/{id}/samples``)."""

    job_id: str
    num_samples: int = Field(description="samples in one epoch of the job")
    offset: int
    next_offset: int | None = Field(description="the offset of the next page; None: this was the last")
    samples: list[JobSample]


class TrainFigures(BaseModel):
    """A trainer's latest training report as its heartbeats carried it (the wire's
    ``messages.TrainReport``, checked there: finite, non-negative, bounded)."""

    step: int = Field(description="the last step it finished")
    loss: float | None = Field(default=None, description="that step's loss")
    steps_per_s: float | None = Field(default=None, description="its steps per second")
    samples_per_s: float | None = Field(default=None, description="its samples per second")


class TrainerInfo(BaseModel):
    """A connected trainer as the delivery endpoint sees it (``GET /v1/overview``)."""

    id: str = Field(description="its socket identity (hex), as the sidecar log names it")
    remote: bool
    jobs: list[str] | None = Field(description="jobs it follows; null: every job")
    credit: int = Field(description="samples it can take now")
    delivered: int
    acked: int
    last_seen_s: float = Field(description="seconds since its last message")
    alive_s: float | None = Field(description="seconds since its stream started (from its heartbeats)")
    wait_share: float | None = Field(
        description="share of its time spent waiting for samples, over the stream's life (0..1)"
    )
    wait_share_recent: float | None = Field(description="the same between its last two heartbeats")
    train: TrainFigures | None = Field(
        default=None, description="its loop's latest training report (step, loss, speed), if it gives one"
    )


class Rates(BaseModel):
    """Consumption (trainers' acks) over the last ``window_s`` seconds."""

    window_s: float
    samples_per_s: float
    tokens_per_s: float


class SpoolUsage(BaseModel):
    file_bytes: int = Field(description="bytes of the sample files in the spool now")
    reserved_bytes: int = Field(description="files plus requests in flight: what admission counts")
    budget_bytes: int = Field(description="HSSTREAM_SPOOL_BUDGET_BYTES")


class JobSummary(BaseModel):
    job_id: str
    done: bool
    num_samples: int
    counts: dict[str, int]


class Overview(BaseModel):
    """One consistent snapshot of the whole sidecar for a live view (``hsstream top``)."""

    jobs_total: int
    jobs_done: int
    jobs: list[JobSummary] = Field(description="the most recent jobs first (at most 20)")
    samples: dict[str, int] = Field(description="samples per state over all jobs")
    ready: int = Field(description="samples produced and waiting for a trainer")
    rates: Rates
    spool: SpoolUsage
    trainers: list[TrainerInfo]
    vllm_down_since_s: float | None


class Health(BaseModel):
    """``GET /healthz``: the process answers (no check of vLLM, the spool or the ledger)."""

    ok: bool


class Readiness(BaseModel):
    """``GET /readyz``: 200 when ready, 503 when not; what is wrong only to holders of the token."""

    ready: bool
    problems: list[str] | None = Field(default=None, description="what is wrong (only with the token)")


class JobBrief(BaseModel):
    """One job in ``GET /v1/jobs``."""

    job_id: str
    done: bool
    counts: dict[str, int]
    compacted: bool


class JobCancelled(BaseModel):
    """``DELETE /v1/jobs/{id}``: what cancelling took back."""

    job_id: str
    cancelled: bool
    aborted_requests: int = Field(description="requests to vLLM aborted")
    removed_files: int = Field(description="sample files removed from the spool")
    counts: dict[str, int]
    purged: bool = Field(default=False, description="with ?purge=true: the job's samples were deleted now")


class SampleSize(BaseModel):
    """Bytes a sample takes on the spool, once known (from the model's config or the first notice)."""

    known: bool
    source: str | None
    num_layers: int | None = None
    hidden_size: int | None = None
    dtype_size: int | None = None
    scale_bytes: int | None = None
    bytes_per_position: int | None = None


class EngineInfo(BaseModel):
    """One vLLM engine as the submitter sees it."""

    url: str
    up: bool
    model: str | None
    max_model_len: int | None
    in_flight: int
    requests: int
    failures: int
    down_for_s: float | None


class ArenaUsage(BaseModel):
    """The arena spool layout's occupancy (``HSSTREAM_SPOOL_LAYOUT=arena``)."""

    size: int = Field(description="bytes of the arena file, its header page included")
    used_bytes: int = Field(description="bytes of the slots samples hold now")
    slots: int = Field(description="slots held now")
    free_bytes: int
    largest_free: int = Field(description="the largest sample that fits now (one contiguous range)")
    quarantined_bytes: int = Field(description="slots given up by abandoned requests, not yet assignable")
    refused: int = Field(description="times a sample waited for want of a free range")


class Stats(BaseModel):
    """``GET /v1/stats``: the sidecar's counters, for diagnosis (``/v1/overview`` is the summary)."""

    reserved_bytes: int
    budget_bytes: int
    sample_size: SampleSize
    engine_max_model_len: int | None
    spool_file_bytes: int
    ready: int
    vllm_down_since_s: float | None
    engines: list[EngineInfo]
    notices: dict[str, int]
    delivery: dict[str, int]
    submitter: dict[str, int]
    states: dict[str, int]
    in_flight: int
    spool_layout: str = "files"
    arena: ArenaUsage | None = None
