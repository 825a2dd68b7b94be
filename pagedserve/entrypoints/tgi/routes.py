"""TGI's routes: /generate, /generate_stream, the compat route ``/`` and /info, all on the default model
(with a lease, held until the response has ended)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve import __version__
from pagedserve.entrypoints.context import get_context
from pagedserve.entrypoints.serving.errors import json_response
from pagedserve.entrypoints.serving.openapi import TGI_ERRORS, error_responses, streaming_ok
from pagedserve.entrypoints.serving.routing import JSON_BODY, respond_leased, with_cancellation
from pagedserve.entrypoints.serving.sse import SSEResponse
from pagedserve.entrypoints.tgi.protocol import CompatGenerateRequest, GenerateRequest

router = APIRouter()
_TGI = error_responses(TGI_ERRORS, tgi=True)


@router.post("/generate", dependencies=JSON_BODY, responses=_TGI)
@with_cancellation
async def tgi_generate(request: GenerateRequest, raw_request: Request) -> Response:
    serving = get_context(raw_request).registry.acquire(None)
    return await respond_leased(serving.release, serving.tgi.generate_response(request))


@router.post(
    "/generate_stream",
    dependencies=JSON_BODY,
    response_class=SSEResponse,
    status_code=200,
    responses={**streaming_ok(json_too=False), **_TGI},
)
async def tgi_generate_stream(request: GenerateRequest, raw_request: Request) -> Response:
    serving = get_context(raw_request).registry.acquire(None)
    return await respond_leased(serving.release, serving.tgi.generate_stream_response(request))


@router.post("/", dependencies=JSON_BODY, responses={**streaming_ok(json_too=True), **_TGI})
@with_cancellation
async def tgi_compat_generate(request: CompatGenerateRequest, raw_request: Request) -> Response:
    serving = get_context(raw_request).registry.acquire(None)
    tgi = serving.tgi
    if request.stream:
        return await respond_leased(serving.release, tgi.generate_stream_response(request))
    return await respond_leased(serving.release, tgi.generate_response(request, wrap_in_list=True))


@router.get("/info")
async def tgi_info(raw_request: Request) -> Response:
    return json_response(get_context(raw_request).registry.default.tgi.info(__version__))
