"""REST request and response bodies (the sidecar's public API, as OpenAPI shows it)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class ShareGPTTurn(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    from_: str = Field(alias="from")
    value: str


class SampleIn(BaseModel):
    """Exactly one of ``prompt``, ``messages``, ``conversations``, ``token_ids``."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    conversations: list[ShareGPTTurn] | None = None
    token_ids: list[TokenId] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> SampleIn:
        given = [k for k in ("prompt", "messages", "conversations", "token_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a sample needs exactly one of prompt, messages, conversations, token_ids (got {given or 'none'})"
            )
        _encodable(self.model_dump(exclude={"token_ids"}, by_alias=True))
        return self


class SamplingOptions(BaseModel):
    """How vLLM writes the new reply in ``regenerate`` mode (the data's own reply is dropped)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_tokens: int = Field(default=256, ge=2, le=32768)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Int64 | None = None


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


class JobIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: list[SampleIn] = Field(min_length=1)
    options: JobOptions = Field(default_factory=JobOptions)


class JobCreated(BaseModel):
    job_id: str
    num_samples: int
    num_failed_at_submission: int = 0


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


class TokenCounts(BaseModel):
    """Token frequencies of a job's data, so a trainer can pick its draft vocabulary before
    step 1. ``counts`` covers loss-masked positions (what the draft learns to predict)."""

    job_id: str
    vocab_size: int | None
    total_tokens: int
    counts: dict[int, int]


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
