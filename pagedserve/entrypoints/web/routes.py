"""The server's own web pages: the playground at ``/``, the live dashboard at ``/dashboard`` with its JSON
at ``/dashboard/stats``, the pages' settings at ``/ui/config``, and their static files under ``/ui/``
(shipped inside the package: no build step, nothing fetched from another host)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Query, Request
from starlette.responses import FileResponse, HTMLResponse, Response

from pagedserve import __version__
from pagedserve.entrypoints.context import get_context
from pagedserve.entrypoints.serving.errors import json_response

STATIC_DIR = Path(__file__).parent / "static"
UI_PREFIX = "/ui"
_NO_STORE = {"Cache-Control": "no-store"}

router = APIRouter()


@router.get("/", response_class=HTMLResponse)  # in /openapi.json: it shares "/" with TGI's POST
async def playground() -> Response:
    """The playground: chat with a served model over the OpenAI chat route."""
    return FileResponse(STATIC_DIR / "playground.html", media_type="text/html")


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    """The live dashboard: queues, the block pool, throughput and latency, refreshed every second."""
    return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html")


@router.get("/dashboard/stats", include_in_schema=False)
async def dashboard_stats(
    raw_request: Request, since: float | None = Query(default=None, description="`now` of an earlier report")
) -> Response:
    """The dashboard's numbers: the latest state, one-minute rates and percentiles, chart points."""
    return json_response(get_context(raw_request).live_stats.report(since), headers=_NO_STORE)


@router.get(UI_PREFIX + "/config", include_in_schema=False)
async def ui_config(raw_request: Request) -> Response:
    """What the pages need to know about the server before their first API call."""
    context = get_context(raw_request)
    return json_response(
        {
            "version": __version__,
            "api_key_required": bool(context.config.http.api_keys),
            "default_model": context.config.default_model.name,
        },
        headers=_NO_STORE,
    )
