"""The OpenAI-compatible routes: thin wrappers that pick the request's model from the registry (with a
lease, held until the response has ended) and call its handlers; /v1/models lists every served name."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve.entrypoints.context import get_context
from pagedserve.entrypoints.model_serving import ModelServing
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedserve.entrypoints.openai.request_checks import model_not_found
from pagedserve.entrypoints.serving.errors import json_response
from pagedserve.entrypoints.serving.openapi import INFERENCE_ERRORS, TOKENIZER_ERRORS, error_responses, streaming_ok
from pagedserve.entrypoints.serving.routing import JSON_BODY, respond_leased, with_cancellation

router = APIRouter()
_INFERENCE = {**streaming_ok(json_too=True), **error_responses(INFERENCE_ERRORS)}
_TOKENIZER = error_responses(TOKENIZER_ERRORS)
_LISTING = error_responses((401, 429, 503))


@router.post("/v1/completions", dependencies=JSON_BODY, responses=_INFERENCE)
@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    serving = get_context(raw_request).registry.acquire(request.model)
    return await respond_leased(serving.release, serving.completion.create_completion(request))


@router.post("/v1/chat/completions", dependencies=JSON_BODY, responses=_INFERENCE)
@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving = get_context(raw_request).registry.acquire(request.model)
    return await respond_leased(serving.release, serving.chat.create_chat_completion(request))


@router.post("/tokenize", dependencies=JSON_BODY, responses=_TOKENIZER)
async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest, raw_request: Request) -> Response:
    serving = get_context(raw_request).registry.acquire(request.model)
    return await respond_leased(serving.release, serving.tokenization.tokenize_request(request))


@router.post("/detokenize", dependencies=JSON_BODY, responses=_TOKENIZER)
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    serving = get_context(raw_request).registry.acquire(request.model)
    return await respond_leased(serving.release, serving.tokenization.detokenize_request(request))


@router.get("/v1/models", responses=_LISTING)
async def show_models(raw_request: Request) -> Response:
    registry = get_context(raw_request).registry
    cards = [_model_card(serving, name) for serving in registry.servings() for name in serving.names]
    return json_response({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}", responses=error_responses((401, 404, 429, 503)))
async def show_model(model_id: str, raw_request: Request) -> Response:
    """OpenAI's ``models.retrieve``: one served name's card (ids may contain '/'), else 404."""
    serving = get_context(raw_request).registry.get(model_id)
    if serving is None:
        raise model_not_found(model_id)
    return json_response(_model_card(serving, model_id))


def _model_card(serving: ModelServing, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": serving.created,
        "owned_by": "pagedserve",
        "root": serving.model_path,
        "parent": None,
        "max_model_len": serving.limits.max_model_len,
        "permission": [],
    }
