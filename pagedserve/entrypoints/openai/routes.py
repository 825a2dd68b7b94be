"""The OpenAI-compatible routes: thin wrappers over the handlers in the server context."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve.entrypoints.context import ServerContext, get_context
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedserve.entrypoints.openai.request_checks import model_not_found
from pagedserve.entrypoints.serving.errors import json_response
from pagedserve.entrypoints.serving.routing import JSON_BODY, with_cancellation

router = APIRouter()


@router.post("/v1/completions", dependencies=JSON_BODY)
@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await get_context(raw_request).completion.create_completion(request)


@router.post("/v1/chat/completions", dependencies=JSON_BODY)
@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await get_context(raw_request).chat.create_chat_completion(request)


@router.post("/tokenize", dependencies=JSON_BODY)
async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest, raw_request: Request) -> Response:
    return await get_context(raw_request).tokenization.tokenize_request(request)


@router.post("/detokenize", dependencies=JSON_BODY)
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return await get_context(raw_request).tokenization.detokenize_request(request)


@router.get("/v1/models")
async def show_models(raw_request: Request) -> Response:
    context = get_context(raw_request)
    cards = [_model_card(context, name) for name in context.models.names]
    return json_response({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}")
async def show_model(model_id: str, raw_request: Request) -> Response:
    """OpenAI's ``models.retrieve``: one served name's card (ids may contain '/'), else 404."""
    context = get_context(raw_request)
    if model_id not in context.models.names:
        raise model_not_found(model_id)
    return json_response(_model_card(context, model_id))


def _model_card(context: ServerContext, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": context.created,
        "owned_by": "pagedserve",
        "root": context.model_root,
        "parent": None,
        "max_model_len": context.engine.model_info.max_model_len,
        "permission": [],
    }
