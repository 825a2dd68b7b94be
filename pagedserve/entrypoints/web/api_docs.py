"""Swagger UI at ``/docs`` and ReDoc at ``/redoc`` that work offline: their scripts, styles and icon
come from the pinned ``fastapi-offline`` package's files, served under ``/ui/api-docs``, and nothing
is asked of a CDN or of Google Fonts (ReDoc's sidebar logo, which its bundle loads from its CDN, is
pointed at the local icon when the bundle is served)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles

ASSETS_PATH = "/ui/api-docs"
OAUTH2_REDIRECT_PATH = "/docs/oauth2-redirect"
REDOC_CDN_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"


def docs_assets_dir() -> Path:
    """The directory of the Swagger UI and ReDoc bundles inside the installed fastapi-offline package."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("fastapi-offline is not installed; it ships the /docs and /redoc assets")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def add_api_docs(app: FastAPI) -> None:
    """Serve /docs, /docs/oauth2-redirect and /redoc from local assets (the app has docs_url=None)."""
    assets = docs_assets_dir()
    redoc_bundle = (
        (assets / "redoc.standalone.js").read_bytes().replace(REDOC_CDN_LOGO, f"{ASSETS_PATH}/favicon.png".encode())
    )
    title = f"{app.title} API"

    async def redoc_js(request: Request) -> Response:
        return Response(redoc_bundle, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=title,
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png",
            oauth2_redirect_url=OAUTH2_REDIRECT_PATH,
            swagger_ui_parameters={"validatorUrl": None},  # no call to the online spec validator
        )

    async def oauth2_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=title,
            redoc_js_url=f"{ASSETS_PATH}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_PATH}/favicon.png",
            with_google_fonts=False,
        )

    # NOTE: the bundle's route comes before the mount, so it answers instead of the file
    app.add_api_route(f"{ASSETS_PATH}/redoc.standalone.js", redoc_js, methods=["GET"], include_in_schema=False)
    app.mount(ASSETS_PATH, StaticFiles(directory=assets), name="api-docs-assets")
    app.add_api_route("/docs", swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route(OAUTH2_REDIRECT_PATH, oauth2_redirect, methods=["GET"], include_in_schema=False)
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
