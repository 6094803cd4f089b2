"""Error responses that can always be encoded.

FastAPI echoes the offending input in a 422, and our 404s name the job id from the path. JSON
text may carry lone surrogates (``"\\ud800"``) and a path may percent-decode to bytes that are
not UTF-8; FastAPI's responses encode with ``ensure_ascii=False`` and then fail on them, turning
a client's mistake into a 500. Escaped ASCII JSON encodes everything and parses the same.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class AsciiJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


async def _validation_error(request: Request, exc: RequestValidationError) -> AsciiJSONResponse:
    return AsciiJSONResponse({"detail": jsonable_encoder(exc.errors())}, status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> AsciiJSONResponse:
    return AsciiJSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
