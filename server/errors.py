"""Error responses that can always be encoded.

FastAPI echoes the offending input in a 422, and our 404s name the job id from the path. JSON
text may carry lone surrogates (``"\\ud800"``) and a path may percent-decode to bytes that are
not UTF-8; FastAPI's responses encode with ``ensure_ascii=False`` and then fail on them, turning
a client's mistake into a 500. Escaped ASCII JSON encodes everything and parses the same.
NaN and infinities it cannot encode at all: a 422 leaves out an input that holds one.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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
    return AsciiJSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
