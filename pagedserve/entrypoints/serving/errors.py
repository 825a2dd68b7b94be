"""API errors: one exception type, rendered in OpenAI's shape (or TGI's on the TGI routes).

OpenAI: ``{"error": {"message", "type", "param", "code"}}``. TGI: ``{"error", "error_type"}``.
Request validation fails with 400 on OpenAI routes (never FastAPI's 422) and 422 on TGI routes.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from pagedserve.entrypoints.input_checks import InputError

TGI_PATHS = frozenset({"/", "/generate", "/generate_stream", "/info"})

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
_TGI_TYPES = {
    422: "validation",
    400: "validation",
    413: "validation",
    429: "overloaded",
    424: "generation",
    500: "incomplete_generation",
    503: "unhealthy",
    408: "timeout",
    401: "authentication",
}


TGI_ERROR_TYPES = frozenset(
    {
        "validation",
        "overloaded",
        "generation",
        "incomplete_generation",
        "healthcheck",
        "unhealthy",
        "timeout",
        "authentication",
        "rate_limited",
    }
)


class APIError(Exception):
    """An error answered to the client with ``status`` (and optional extra headers)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def openai_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type or _OPENAI_TYPES.get(self.status, HTTPStatus(self.status).phrase),
                "param": self.param,
                "code": self.code,
            }
        }

    def tgi_body(self) -> dict:
        if self.type in TGI_ERROR_TYPES:
            error_type = self.type
        else:
            error_type = _TGI_TYPES.get(self.status, "validation")
        message = "Model is overloaded" if self.code == "server_overloaded" else self.message
        return {"error": message, "error_type": error_type}


def is_tgi_path(path: str) -> bool:
    return path in TGI_PATHS


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def error_response(error: APIError, path: str) -> Response:
    if is_tgi_path(path):
        status = 422 if error.status == 400 else error.status
        return json_response(error.tgi_body(), status, error.headers)
    return json_response(error.openai_body(), error.status, error.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param=param, code=code)


def from_input_error(error: InputError) -> APIError:
    """A failed input check as a 400 (a 422 on the TGI routes)."""
    return APIError(error.message, 400, param=error.param, code=error.code)


def param_from_message(message: str) -> str | None:
    """SamplingParams messages start with the field name (``top_p must be ...``)."""
    first = message.split(" ", 1)[0].strip("`'\":,")
    return first if first.isidentifier() else None


def format_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable one-line message and the first offending parameter of a pydantic error."""
    parts = []
    param = None
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            parts.append(f"Invalid JSON body: {detail}".rstrip(": "))
            continue
        where = ".".join(loc)
        if param is None and where:
            param = where
        message = str(error.get("msg", "invalid value"))
        parts.append(f"{where}: {message}" if where else message)
        if len(parts) >= 5:
            break
    return "; ".join(parts) or "Invalid request", param


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app answers at this path (Starlette's 405 names only the first
    route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        route_methods = getattr(route, "methods", None)
        if match != Match.NONE and route_methods:
            methods.update(route_methods)
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """400 (OpenAI) / 422 (TGI) for validation, OpenAI-shaped HTTP errors, 500 for anything else."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, request.url.path)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError) -> Response:
        return error_response(from_input_error(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = format_validation_error(exc)
        return error_response(APIError(message, 400, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = "The request body is not valid JSON (or not valid UTF-8)."
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
        return error_response(APIError(message, exc.status_code, headers=headers), request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        return error_response(APIError(f"Internal server error: {exc!r}", 500), request.url.path)
