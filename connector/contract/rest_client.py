"""The one client of the sidecar's REST API (``connector/contract/rest.py``), on httpx.

Every process that talks to the sidecar goes through :class:`SidecarClient`: the trainer
(submit, job sizes, token counts, the drained probe), the CLI (``hsstream submit``, ``status``,
``top``), the demo and the benchmarks. So the bearer header is built in one place
(:func:`auth_headers`), every refusal and every failure to reach the sidecar is one exception
(:class:`SidecarError`, with the HTTP status and the server's ``detail``), and every answer is
parsed with the models the routes declare: an answer that no longer matches them fails here,
loudly, instead of as a ``KeyError`` somewhere in a caller.

Sync only: no caller of the sidecar's REST API runs an event loop (the asyncio code that
speaks HTTP talks to vLLM, not to the sidecar).

The upload body (:func:`multipart_jsonl`) is made on the fly from an iterable of samples, so
a client holds one chunk of rows, never the whole job.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from typing import Any, Protocol

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from connector.contract.rest import (
    Health,
    JobBrief,
    JobCancelled,
    JobCreated,
    JobSample,
    JobSamples,
    JobOptions,
    JobStatus,
    Overview,
    Readiness,
    SampleError,
    Stats,
    TokenCounts,
)

#: Where the bearer token comes from when none is passed (the variable the sidecar checks).
TOKEN_ENV = "HSSTREAM_API_TOKEN"
DEFAULT_TIMEOUT_S = 60.0
#: How long an upload waits for the sidecar's answer once its body is sent: the sidecar answers
#: when every row is tokenised and queued, which for a big file takes minutes.
ADMIT_TIMEOUT_S = 3600.0

Options = JobOptions | Mapping[str, Any] | None


class HttpClient(Protocol):
    """What :class:`SidecarClient` needs of the client it sends through: httpx's ``Client`` has it,
    and so has any client on the same API — Starlette's ``TestClient`` is an ``httpx2.Client`` as of
    Starlette 1.10. So nothing here may hand it one library's own types (an ``httpx.Timeout``,
    which httpx2 refuses): timeouts go as plain numbers, errors are caught by the client's own
    library's ``HTTPError`` (:func:`transport_errors`)."""

    base_url: Any

    def request(self, method: str, url: str, **kw: Any) -> Any: ...  # noqa: ANN401

    def close(self) -> None: ...


def transport_errors(http: object) -> tuple[type[BaseException], ...]:
    """The ``HTTPError`` classes of the libraries ``http``'s class comes from (its MRO), beside
    httpx's: a failure to reach the sidecar is a :class:`SidecarError` whichever library sent."""
    errors: list[type[BaseException]] = [httpx.HTTPError]
    for cls in type(http).__mro__:
        lib = sys.modules.get(cls.__module__.partition(".")[0])
        err = getattr(lib, "HTTPError", None)
        if isinstance(err, type) and issubclass(err, BaseException) and err not in errors:
            errors.append(err)
    return tuple(errors)


def timeouts(default_s: float, *, read_s: float | None = None) -> tuple[float, float, float, float]:
    """A per-request timeout as (connect, read, write, pool) seconds: the one form httpx and
    httpx2 both take without importing either's ``Timeout``."""
    return (default_s, default_s if read_s is None else read_s, default_s, default_s)


def auth_headers(token: str | None) -> dict[str, str]:
    """The header ``server/dependencies.py:require_token`` checks; none without a token."""
    return {"authorization": f"Bearer {token}"} if token else {}


class SidecarError(RuntimeError):
    """The sidecar refused a call (``status``: its HTTP status, ``detail``: its ``detail``),
    could not be reached (``status`` None), or answered what the contract does not describe."""

    def __init__(
        self, message: str, *, status: int | None, detail: Any = None, method: str = "", path: str = ""  # noqa: ANN401
    ) -> None:
        super().__init__(message)
        self.status, self.detail, self.method, self.path = status, detail, method, path

    @property
    def unreachable(self) -> bool:
        return self.status is None


class UploadCounter:
    """Rows and bytes an upload body has produced so far (read by a progress bar)."""

    def __init__(self) -> None:
        self.rows = 0
        self.bytes = 0


def multipart_jsonl(
    samples: Iterable[Mapping[str, Any]],
    *,
    boundary: str,
    options: str = "{}",
    filename: str = "samples.jsonl",
    chunk_bytes: int = 1 << 16,
    counter: UploadCounter | None = None,
) -> Iterator[bytes]:
    """The ``/v1/jobs/upload`` multipart body, made on the fly: the ``options`` field, then the
    ``file`` field's JSONL, one line per sample, in chunks of about ``chunk_bytes``. Nothing but
    the current chunk is held: the client's memory is flat in the number of rows."""
    b = boundary.encode()
    yield (b"--" + b + b'\r\nContent-Disposition: form-data; name="options"\r\n\r\n' + options.encode() + b"\r\n"
           b"--" + b + b'\r\nContent-Disposition: form-data; name="file"; filename="'
           + filename.replace('"', "").encode() + b'"\r\nContent-Type: application/x-ndjson\r\n\r\n')  # fmt: skip
    parts: list[bytes] = []
    size = 0
    for s in samples:
        line = json.dumps(s, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode() + b"\n"
        parts.append(line)
        size += len(line)
        if counter is not None:
            counter.rows += 1
            counter.bytes += len(line)
        if size >= chunk_bytes:
            yield b"".join(parts)
            parts, size = [], 0
    if parts:
        yield b"".join(parts)
    yield b"\r\n--" + b + b"--\r\n"


def _options(options: Options) -> dict[str, Any]:
    if options is None:
        return {}
    if isinstance(options, BaseModel):
        return options.model_dump(mode="json", exclude_unset=True)
    return dict(options)


@cache
def _adapter(tp: Any) -> TypeAdapter:  # noqa: ANN401 - a model class or list[model]
    return TypeAdapter(tp)


def _detail(r: httpx.Response) -> Any:  # noqa: ANN401 - whatever the server put in ``detail``
    try:
        body = r.json()
    except ValueError:
        return r.text[:2000]
    return body.get("detail", body) if isinstance(body, dict) else body


class SidecarClient:
    """The sidecar's REST API as typed calls; a context manager (closes its connections).

    ``base_url``: e.g. ``http://127.0.0.1:8100``. ``token``: the bearer token; None reads
    ``HSSTREAM_API_TOKEN``, ``""`` sends none. ``timeout``: seconds per call (an upload waits
    ``admit_timeout_s`` for its answer). ``http``: a client to send through (an ``httpx.Client``,
    or a FastAPI ``TestClient``, which is an ``httpx2.Client`` on Starlette ≥ 1.10: anything with
    httpx's API, :class:`HttpClient`); it is the caller's to close."""

    #: Makes the ``httpx.Client`` when none is given (tests point it at an in-process app).
    http_factory = httpx.Client

    def __init__(
        self, base_url: str | None = None, *, token: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
        http: HttpClient | None = None,
    ) -> None:  # fmt: skip
        if http is None and not base_url:
            raise ValueError("SidecarClient needs the sidecar's URL (base_url) or an httpx client (http)")
        self.timeout = timeout
        self._headers = auth_headers(os.environ.get(TOKEN_ENV) if token is None else token)
        self._owned = http is None
        if http is None:
            http = type(self).http_factory(base_url=str(base_url).rstrip("/"), timeout=timeout)
        self._http = http
        self._errors = transport_errors(http)

    @property
    def base_url(self) -> str:
        return str(self._http.base_url).rstrip("/")

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the calls
    def healthz(self) -> Health:
        return self._call("GET", "/healthz", Health)

    def readyz(self) -> Readiness:
        """Ready or not (503 is an answer here, not an error); ``problems`` only with the token."""
        return self._call("GET", "/readyz", Readiness, ok=(200, 503))

    def create_job(self, samples: Iterable[Mapping[str, Any]], options: Options = None) -> JobCreated:
        """``POST /v1/jobs``: the samples in one JSON body (see :meth:`upload` for big jobs)."""
        body: dict[str, Any] = {"samples": list(samples)}
        if options is not None:
            body["options"] = _options(options)
        return self._call("POST", "/v1/jobs", JobCreated, json=body)

    def upload(
        self, samples: Iterable[Mapping[str, Any]], options: Options | str = None, *, filename: str = "samples.jsonl",
        counter: UploadCounter | None = None, admit_timeout_s: float = ADMIT_TIMEOUT_S,
    ) -> JobCreated:  # fmt: skip
        """``POST /v1/jobs/upload`` with JSONL made on the fly (sent chunked, as ``samples`` is
        iterated). An exception ``samples`` raises is raised again as it is, after taking back
        a job the cut body still made (nothing stays queued from a source that broke)."""
        opts = options if isinstance(options, str) else json.dumps(_options(options))
        boundary = uuid.uuid4().hex
        failed: list[BaseException] = []

        def source() -> Iterator[Mapping[str, Any]]:
            try:
                yield from samples
            except Exception as e:  # the source broke mid-way: whatever the sidecar makes of the cut body, say this
                failed.append(e)
                raise

        body = multipart_jsonl(source(), boundary=boundary, options=opts, filename=filename, counter=counter)
        try:
            r = self._send("POST", "/v1/jobs/upload", content=body,
                           headers={"content-type": f"multipart/form-data; boundary={boundary}"},
                           timeout=timeouts(self.timeout, read_s=admit_timeout_s))  # fmt: skip
        except Exception:
            if failed:
                raise failed[0] from None
            raise
        if failed:
            if r.status_code == 200:  # the cut body still parsed (a transport that does not abort): take it back
                with contextlib.suppress(SidecarError):
                    self.cancel(self._parse(r, JobCreated, "POST", "/v1/jobs/upload").job_id)
            raise failed[0]
        return self._parse(self._check(r, "POST", "/v1/jobs/upload"), JobCreated, "POST", "/v1/jobs/upload")

    def jobs(self) -> list[JobBrief]:
        return self._call("GET", "/v1/jobs", list[JobBrief])

    def job(self, job_id: str, *, errors_offset: int = 0, errors_limit: int = 100) -> JobStatus:
        """A job's status with one page of its sample errors (see :meth:`job_errors` for all)."""
        params = {"errors_offset": errors_offset, "errors_limit": errors_limit}
        return self._call("GET", f"/v1/jobs/{job_id}", JobStatus, params=params)

    def job_errors(self, job_id: str, *, page_size: int = 1000) -> Iterator[SampleError]:
        """Every sample error of a job, a page (``errors_limit``, at most 1000) per call."""
        offset = 0
        while True:
            page = self.job(job_id, errors_offset=offset, errors_limit=page_size).errors
            yield from page
            offset += len(page)
            if len(page) < page_size:
                return

    def token_counts(self, job_id: str) -> TokenCounts:
        return self._call("GET", f"/v1/jobs/{job_id}/token_counts", TokenCounts)

    def job_samples(self, job_id: str, *, offset: int = 0, limit: int = 100, eval_fraction: float | None = None,
                    eval_seed: int = 0) -> JobSamples:  # fmt: skip
        """One page of a job's samples (token ids, masks, ids), in index order: ``limit`` (≤ 1000)
        rows looked at, bounded in tokens by the sidecar; with ``eval_fraction``, only those the
        held-out rule (connector/contract/holdout.py) picks."""
        params: dict = {"offset": offset, "limit": limit}
        if eval_fraction is not None:
            params.update(eval_fraction=eval_fraction, eval_seed=eval_seed)
        return self._call("GET", f"/v1/jobs/{job_id}/samples", JobSamples, params=params)

    def iter_job_samples(self, job_id: str, *, page_size: int = 1000, eval_fraction: float | None = None,
                         eval_seed: int = 0) -> Iterator[JobSample]:  # fmt: skip
        """Every sample of a job (or its held-out share), a page per call (bounded memory on both sides)."""
        offset: int | None = 0
        while offset is not None:
            page = self.job_samples(job_id, offset=offset, limit=page_size, eval_fraction=eval_fraction,
                                    eval_seed=eval_seed)  # fmt: skip
            yield from page.samples
            offset = page.next_offset

    def cancel(self, job_id: str, *, purge: bool = False) -> JobCancelled:
        """``DELETE /v1/jobs/{id}``; ``purge``: also delete its samples now (not after the retention)."""
        params = {"purge": "true"} if purge else None
        return self._call("DELETE", f"/v1/jobs/{job_id}", JobCancelled, params=params)

    def stats(self) -> Stats:
        return self._call("GET", "/v1/stats", Stats)

    def overview(self) -> Overview:
        return self._call("GET", "/v1/overview", Overview)

    def metrics(self) -> str:
        """The Prometheus text exposition."""
        return self._send_ok("GET", "/metrics").text

    def openapi(self) -> dict[str, Any]:
        """The OpenAPI schema (behind the token, like every route but the probes)."""
        return self._send_ok("GET", "/openapi.json").json()

    # ------------------------------------------------------------------ the one path every call takes
    def _call(self, method: str, path: str, tp: Any, *, ok: tuple[int, ...] = (200,), **kw: Any) -> Any:  # noqa: ANN401
        return self._parse(self._send_ok(method, path, ok=ok, **kw), tp, method, path)

    def _send(
        self, method: str, path: str, *, headers: Mapping[str, str] | None = None, **kw: Any  # noqa: ANN401
    ) -> httpx.Response:
        try:
            return self._http.request(method, path, headers={**self._headers, **(headers or {})}, **kw)
        except self._errors as e:
            raise SidecarError(f"sidecar not reachable at {self.base_url}: {e}", status=None, detail=str(e),
                               method=method, path=path) from e  # fmt: skip

    def _send_ok(
        self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kw: Any  # noqa: ANN401
    ) -> httpx.Response:
        return self._check(self._send(method, path, **kw), method, path, ok)

    @staticmethod
    def _check(r: httpx.Response, method: str, path: str, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        if r.status_code not in ok:
            d = _detail(r)
            raise SidecarError(f"{r.status_code}: {d}", status=r.status_code, detail=d, method=method, path=path)
        return r

    @staticmethod
    def _parse(r: httpx.Response, tp: Any, method: str, path: str) -> Any:  # noqa: ANN401
        try:
            return _adapter(tp).validate_json(r.content)
        except ValidationError as e:
            raise SidecarError(
                f"{method} {path}: the sidecar's answer does not match connector/contract/rest.py "
                f"(a sidecar of another version?): {e}", status=r.status_code, detail=r.text[:2000],
                method=method, path=path,
            ) from e  # fmt: skip
