"""The OpenAPI schema and Swagger UI, behind the token like every route but the probes.

FastAPI serves these itself by default, outside any router's dependencies; ``create_app`` turns
those off and this router serves them instead. With a token set, fetch the schema with the
``Authorization`` header (a browser's Swagger page cannot send it)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel

from server.dependencies import require_token

router = APIRouter(include_in_schema=False, dependencies=[Depends(require_token)])


def add_request_bodies(app, *models: type[BaseModel]) -> None:  # noqa: ANN001
    """Put ``models`` (and the models they use) in the app's OpenAPI components: bodies a route
    reads itself rather than as a FastAPI body parameter (``POST /v1/jobs`` parses its JSON off
    the event loop), which the route's ``openapi_extra`` names by reference."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in js.pop("$defs", {}).items():
                    comps.setdefault(name, sub)
                comps.setdefault(m.__name__, js)
        return app.openapi_schema

    app.openapi = openapi


@router.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="hsstream sidecar")
