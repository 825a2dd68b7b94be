"""What /openapi.json says about errors and auth: the error bodies (OpenAI's and TGI's shapes), the
statuses each group of routes can answer, the bearer-key security scheme, and the schema fix-ups
FastAPI cannot express (our validation answers 400 on OpenAI routes, not FastAPI's 422)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from pagedserve.entrypoints.serving.errors import is_tgi_path

BEARER_SCHEME = "bearerAuth"
_VALIDATION_REF = "#/components/schemas/HTTPValidationError"


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class OpenAIErrorResponse(BaseModel):
    """Every error on the OpenAI, tokenizer, admin and server routes."""

    error: OpenAIErrorDetail


class TGIErrorResponse(BaseModel):
    """Every error on TGI's routes (and /health's 503)."""

    error: str
    error_type: str = Field(description="validation, overloaded, generation, unhealthy, timeout, authentication, ...")


_DESCRIPTIONS = {
    400: "Invalid request: a field out of range, a prompt too long for the model, an unsupported option",
    401: "Missing or wrong key (`Authorization: Bearer <key>`) where the server has keys",
    404: "No such model (or route)",
    408: "The request ran past the server's per-request timeout and was aborted",
    409: "A model of that name is already loading",
    413: "Request body over the server's limit",
    422: "Invalid request (TGI's status for validation errors)",
    429: "Overloaded (the queue is full) or rate limited; retry after `Retry-After` seconds",
    503: "Starting up, shutting down, or the engine is down; retry after `Retry-After` seconds",
}


def error_responses(statuses: Iterable[int], *, tgi: bool = False) -> dict[int | str, dict[str, Any]]:
    """A ``responses=`` mapping for FastAPI: each status with its description and error body."""
    model = TGIErrorResponse if tgi else OpenAIErrorResponse
    return {status: {"model": model, "description": _DESCRIPTIONS[status]} for status in statuses}


def streaming_ok(*, json_too: bool) -> dict[int | str, dict[str, Any]]:
    """The 200 of a route that streams server-sent events (only, or with ``"stream": true``)."""
    content: dict[str, Any] = {"text/event-stream": {"schema": {}}}  # each event's data: JSON, or [DONE]
    if json_too:
        content = {"application/json": {"schema": {}}, **content}
        return {200: {"description": 'The result; server-sent events with `"stream": true`', "content": content}}
    return {200: {"description": "Server-sent events", "content": content}}


INFERENCE_ERRORS = (400, 401, 404, 408, 413, 429, 503)
TOKENIZER_ERRORS = (400, 401, 404, 413, 429, 503)
TGI_ERRORS = (401, 408, 413, 422, 429, 503)
ADMIN_ERRORS = (400, 401, 404, 409, 413, 503)


def install_openapi(
    app: FastAPI, *, guarded: Callable[[str, str], bool], api_keys: bool, admin_key: bool, metrics_key: bool
) -> None:
    """Replace ``app.openapi`` with one that drops FastAPI's 422 where validation answers 400 and declares
    the bearer scheme on the routes that check a key: the API keys' routes, the admin routes (their own
    key) and /metrics where it is protected."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.get("responses", {})
                _errors_as_json(responses)
                if not is_tgi_path(path) and _is_fastapi_validation(responses.get("422")):
                    del responses["422"]
                if path.startswith("/admin"):
                    secured = admin_key
                elif path == "/metrics":
                    secured = metrics_key
                else:
                    secured = api_keys and guarded(path, method.upper())
                if secured:
                    operation["security"] = [{BEARER_SCHEME: []}]
        if api_keys or admin_key or metrics_key:
            schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
            schemes[BEARER_SCHEME] = {"type": "http", "scheme": "bearer"}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _errors_as_json(responses: dict[str, Any]) -> None:
    """Error bodies are JSON on every route (FastAPI files them under a streaming route's media type); an
    event stream's events are JSON or ``[DONE]`` (FastAPI says "string")."""
    for status, response in responses.items():
        content = response.get("content", {})
        if "text/event-stream" in content:
            content["text/event-stream"] = {"schema": {}}
        if status.isdigit() and int(status) >= 400 and "text/event-stream" in content:
            content["application/json"] = content.pop("text/event-stream")


def _is_fastapi_validation(response: dict[str, Any] | None) -> bool:
    if not response:
        return False
    content = response.get("content", {}).get("application/json", {})
    return content.get("schema", {}).get("$ref") == _VALIDATION_REF
