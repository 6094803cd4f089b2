"""The OpenAPI schema and Swagger UI, behind the token like every route but the probes.

FastAPI serves these itself by default, outside any router's dependencies; ``create_app`` turns
those off and this router serves them instead. With a token set, fetch the schema with the
``Authorization`` header (a browser's Swagger page cannot send it)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from server.dependencies import require_token

router = APIRouter(include_in_schema=False, dependencies=[Depends(require_token)])


@router.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="hsstream sidecar")
