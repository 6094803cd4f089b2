"""Error responses that can always be encoded.

FastAPI echoes the offending input in a 422, and our 404s name the job id from the path. JSON
text may carry lone surrogates (``"\\ud800"``) and a path may percent-decode to bytes that are
not UTF-8; FastAPI's responses encode with ``ensure_ascii=False`` and then fail on them, turning
a client's mistake into a 500. Escaped ASCII JSON encodes everything and parses the same.
NaN and infinities it cannot encode at all: a 422 leaves out an input that holds one.

The sidecar's own storage failing (a full ledger volume, a full temporary directory for an
upload) is answered 507 (or 503 while the ledger cannot write), never an unhandled 500.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.ledger.store import LedgerUnsaved, is_disk_error

log = logging.getLogger("hsstream.sidecar")


class AsciiJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _finite(v: object) -> bool:
    """Whether JSON can carry ``v`` back: no NaN or infinity anywhere in it."""
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return all(_finite(x) for x in v)
    return True


async def _validation_error(request: Request, exc: RequestValidationError) -> AsciiJSONResponse:
    # The offending input is echoed only when JSON can carry it: a NaN or an infinity in it (a
    # client may send them; JSON cannot encode them back) would turn the 422 into a 500.
    errors = [e if _finite(e) else {k: v for k, v in e.items() if k not in ("input", "ctx")} for e in exc.errors()]
    return AsciiJSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> AsciiJSONResponse:
    if exc.status_code == 400 and (full := storage_refusal(exc.__cause__)) is not None:
        # FastAPI calls any failure to read a form "an error parsing the body": an upload
        # spooled to a full disk is the server's lack of room, not the client's mistake.
        return AsciiJSONResponse({"detail": full[1]}, status_code=full[0], headers={"connection": "close"})
    return AsciiJSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def storage_refusal(exc: BaseException | None) -> tuple[int, str] | None:
    """(status, detail) for a failure of the sidecar's own storage, anywhere in ``exc``'s chain:
    507 when a volume is full (the ledger's, the temporary files' of an upload), 503 while the
    ledger cannot write (``LedgerUnsaved``); None for anything else."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, LedgerUnsaved):
            return 503, f"the sidecar cannot write its ledger now (disk full?): try again later ({exc})"
        if isinstance(exc, sqlite3.Error) and is_disk_error(exc):
            return 507, f"the sidecar's ledger volume is full or failing ({exc}): nothing was queued; free space and try again"
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" ({exc.filename})" if exc.filename else ""
            return 507, f"the sidecar ran out of disk space{where}: nothing was queued; free space and try again"
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


async def _storage_error(request: Request, exc: Exception) -> AsciiJSONResponse:
    """A full disk or a ledger that cannot write is an answer (507 / 503), never an unhandled 500."""
    refusal = storage_refusal(exc)
    if refusal is None:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return AsciiJSONResponse({"detail": "internal error (see the sidecar's log)"}, status_code=500)
    log.warning("%s %s refused: %s", request.method, request.url.path, refusal[1])
    return AsciiJSONResponse({"detail": refusal[1]}, status_code=refusal[0], headers={"connection": "close"})


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(sqlite3.Error, _storage_error)  # type: ignore[arg-type]
    app.add_exception_handler(OSError, _storage_error)  # type: ignore[arg-type]
