"""Routes say which body they take; a request with another content type is told which.

FastAPI would otherwise try the body anyway and answer with a validation error about a
"dictionary" or a missing ``file`` field, which does not say what went wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from email.message import Message

from fastapi import HTTPException, Request


def media_type(header: str | None) -> str:
    m = Message()
    m["content-type"] = header or ""
    return m.get_content_type() if header else ""


def expects(expected: str) -> Callable[[Request], None]:
    """A dependency that refuses (415) a body of any other media type than ``expected``
    (``application/json`` also takes ``+json`` types and no content type, as FastAPI does)."""

    def check(request: Request) -> None:
        got = media_type(request.headers.get("content-type"))
        plus_json = got.startswith("application/") and got.endswith("+json")
        json_like = expected == "application/json" and (not got or plus_json)
        if got == expected or json_like:
            return
        raise HTTPException(415, f"this route takes a {expected} body; the request's content type is "
                                 f"{got or 'missing'} (set Content-Type: {expected})")  # fmt: skip

    return check
