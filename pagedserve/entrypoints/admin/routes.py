"""The admin routes (``/admin/models``), each behind the admin key: list, load or swap, remove."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from pagedserve.entrypoints.admin.auth import require_admin
from pagedserve.entrypoints.admin.protocol import LoadModelRequest
from pagedserve.entrypoints.admin.service import AdminService, model_entry
from pagedserve.entrypoints.context import get_context
from pagedserve.entrypoints.model_serving import DRAINING, LOADING
from pagedserve.entrypoints.serving.errors import json_response
from pagedserve.entrypoints.serving.openapi import ADMIN_ERRORS, error_responses
from pagedserve.entrypoints.serving.routing import JSON_BODY

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], responses=error_responses(ADMIN_ERRORS))


def _service(raw_request: Request) -> AdminService:
    return get_context(raw_request).admin


@router.get("/models")
async def list_models(raw_request: Request) -> Response:
    return json_response({"models": _service(raw_request).list_models()})


@router.post("/models", dependencies=JSON_BODY)
async def load_model(request: LoadModelRequest, raw_request: Request, wait: bool = True) -> Response:
    """Load ``model`` as ``name`` (a served name: blue/green swap). 200 with its entry once it serves;
    ``?wait=false``: 202 at once, then poll GET /admin/models."""
    spec, task = _service(raw_request).start_load(request)
    if not wait:
        return json_response({"name": spec.name, "state": LOADING}, 202)
    serving = await asyncio.shield(task)  # NOTE: a client gone mid-load does not cancel the load
    return json_response(model_entry(serving))


@router.delete("/models/{name:path}")
async def remove_model(name: str, raw_request: Request) -> Response:
    serving = _service(raw_request).remove(name)
    return json_response({"name": serving.name, "state": DRAINING})
