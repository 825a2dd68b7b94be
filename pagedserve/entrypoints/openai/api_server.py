"""The HTTP app: ``build_app`` = thin routes over the serving classes, middleware, error handlers,
and a lifespan that warms up and starts the engine (``launcher.run_server`` serves it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from pagedserve import __version__
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RateLimitMiddleware,
    ServerState,
    ServerStateMiddleware,
    TimingMiddleware,
    parse_rate_limit,
)
from pagedserve.entrypoints.openai.errors import APIError, install_error_handlers, json_response
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_engine import AdmissionControl, ServingConfig
from pagedserve.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from pagedserve.entrypoints.tgi.protocol import CompatGenerateRequest, GenerateRequest
from pagedserve.entrypoints.tgi.serving import TGIServing
from pagedserve.metrics import CONTENT_TYPE, Metrics, StatsLogLine

logger = logging.getLogger("pagedserve.server")


@dataclass(slots=True)
class ServerOptions:
    """HTTP-level options (the CLI fills them; tests may build them directly)."""

    api_keys: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    rate_limit: str | None = None
    max_request_bytes: int = 8 << 20
    log_stats_interval: float = 10.0


# --------------------------------------------------------------------------------------- routes
def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancel the handler (aborting its requests) when the client disconnects.

    ``request.is_disconnected()`` does not work behind middleware, so the handler races a task that
    waits for ``http.disconnect``. Streaming responses are watched by Starlette itself once returned.
    """

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        raw_request: Request = kwargs["raw_request"]
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait((handler_task, disconnect_task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect_task.cancel()
        if handler_task in done:
            return handler_task.result()
        handler_task.cancel()
        await asyncio.gather(handler_task, return_exceptions=True)
        return Response(status_code=499)  # never read: the client is gone

    return wrapper


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def validate_json_request(raw_request: Request) -> None:
    media_type = raw_request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError("Unsupported Media Type: Only 'application/json' is allowed", 400, code="unsupported_media_type")


def _app_state(request: Request) -> Any:
    return request.app.state


router = APIRouter()
_json = [Depends(validate_json_request)]


@router.post("/v1/completions", dependencies=_json)
@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await _app_state(raw_request).serving_completion.create_completion(request)


@router.post("/v1/chat/completions", dependencies=_json)
@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await _app_state(raw_request).serving_chat.create_chat_completion(request)


@router.post("/tokenize", dependencies=_json)
async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest, raw_request: Request) -> Response:
    return await _app_state(raw_request).serving_tokenize.tokenize_request(request)


@router.post("/detokenize", dependencies=_json)
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return await _app_state(raw_request).serving_tokenize.detokenize_request(request)


@router.get("/v1/models")
async def show_models(raw_request: Request) -> Response:
    state = _app_state(raw_request)
    cards = [_model_card(state, name) for name in state.serving_config.served_model_names]
    return json_response({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}")
async def show_model(model_id: str, raw_request: Request) -> Response:
    """OpenAI's ``models.retrieve``: one served name's card (ids may contain '/'), else 404."""
    state = _app_state(raw_request)
    if model_id not in state.serving_config.served_model_names:
        raise APIError(f"The model `{model_id}` does not exist.", 404, param="model", code="model_not_found")
    return json_response(_model_card(state, model_id))


def _model_card(state: Any, name: str) -> dict[str, Any]:
    config: ServingConfig = state.serving_config
    info = state.engine.model_info
    return {"id": name, "object": "model", "created": state.created, "owned_by": "pagedserve",
            "root": config.model_path or info.model_name, "parent": None, "max_model_len": info.max_model_len,
            "permission": []}


@router.post("/generate", dependencies=_json)
@with_cancellation
async def tgi_generate(request: GenerateRequest, raw_request: Request) -> Response:
    return await _app_state(raw_request).serving_tgi.generate_response(request)


@router.post("/generate_stream", dependencies=_json)
async def tgi_generate_stream(request: GenerateRequest, raw_request: Request) -> Response:
    return await _app_state(raw_request).serving_tgi.generate_stream_response(request)


@router.post("/", dependencies=_json)
@with_cancellation
async def tgi_compat_generate(request: CompatGenerateRequest, raw_request: Request) -> Response:
    serving: TGIServing = _app_state(raw_request).serving_tgi
    if request.stream:
        return await serving.generate_stream_response(request)
    return await serving.generate_response(request, wrap_in_list=True)


@router.get("/info")
async def tgi_info(raw_request: Request) -> Response:
    state = _app_state(raw_request)
    return json_response(state.serving_tgi.info(__version__, state.model_dtype))


@router.get("/health")
@router.get("/ping")
async def health(raw_request: Request) -> Response:
    state = _app_state(raw_request)
    server_state: ServerState = state.server_state
    engine: AsyncLLM = state.engine
    if engine.is_dead:
        return json_response({"error": "unhealthy: the engine core died", "error_type": "healthcheck"}, 503)
    if server_state.draining:
        return json_response({"error": "unhealthy: shutting down", "error_type": "healthcheck"}, 503)
    if not server_state.ready:
        return json_response({"error": "not ready: warming up", "error_type": "healthcheck"}, 503)
    return Response(status_code=200)


@router.get("/version")
async def show_version() -> Response:
    return json_response({"version": __version__})


@router.get("/load")
async def show_load(raw_request: Request) -> Response:
    return json_response({"server_load": _app_state(raw_request).engine.num_unfinished_requests})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(_app_state(raw_request).metrics.render(), media_type=CONTENT_TYPE)


# --------------------------------------------------------------------------------------- app
def build_app(
    engine: AsyncLLM,
    serving_config: ServingConfig,
    options: ServerOptions,
    server_state: ServerState | None = None,
    model_dtype: str | None = None,
) -> FastAPI:
    """The FastAPI app over a (not yet started) AsyncLLM. Its lifespan warms up and starts the engine."""
    server_state = server_state or ServerState()
    metrics = Metrics(serving_config.model_name, engine.get_stats, engine.model_info.block_size,
                      engine.model_info.num_kv_blocks)
    engine.stat_observers.append(metrics.record)
    stats_line = StatsLogLine(engine.get_stats)
    engine.stat_observers.append(stats_line.record)
    capacity = None
    if serving_config.max_queued_requests is not None:
        capacity = serving_config.max_running_requests + serving_config.max_queued_requests
    admission = AdmissionControl(capacity, serving_config.retry_after_s, on_reject=metrics.record_rejected)

    app = FastAPI(title="pagedserve", version=__version__, lifespan=_lifespan,
                  description="OpenAI- and TGI-compatible LLM inference server")
    app.include_router(router)
    install_error_handlers(app)
    state = app.state
    state.engine = engine
    state.server_state = server_state
    state.serving_config = serving_config
    state.metrics = metrics
    state.stats_line = stats_line
    state.options = options
    state.model_dtype = model_dtype
    state.created = int(time.time())
    state.serving_completion = OpenAIServingCompletion(engine, serving_config, admission)
    state.serving_chat = OpenAIServingChat(engine, serving_config, admission)
    state.serving_tokenize = OpenAIServingTokenization(engine, serving_config, admission)
    state.serving_tgi = TGIServing(engine, serving_config, admission)
    state.background_tasks = set()

    # NOTE: add_middleware wraps the app, so the last added runs first (outermost).
    if options.rate_limit:
        limit, period = parse_rate_limit(options.rate_limit)
        app.add_middleware(RateLimitMiddleware, limit=limit, period_s=period, on_reject=metrics.record_rejected)
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=options.api_keys)
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_bytes)
    app.add_middleware(ServerStateMiddleware, state=server_state)
    app.add_middleware(TimingMiddleware)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                           allow_credentials=options.allow_credentials, allow_methods=options.allowed_methods,
                           allow_headers=options.allowed_headers)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state = app.state
    task = asyncio.create_task(_start_engine(app), name="engine-start")
    state.background_tasks.add(task)
    try:
        yield
    finally:
        for background in list(state.background_tasks):
            background.cancel()
        await asyncio.gather(*state.background_tasks, return_exceptions=True)
        await state.engine.shutdown()


async def _start_engine(app: FastAPI) -> None:
    state = app.state
    engine: AsyncLLM = state.engine
    core = engine.core
    warmup = getattr(core, "warmup", None)
    start = time.perf_counter()
    try:
        if warmup is not None:
            await warmup()
        await engine.start()
    except Exception as exc:  # noqa: BLE001 - a server that cannot start must exit non-zero
        logger.exception("engine start-up failed")
        on_fatal = getattr(state, "on_fatal", None)
        if on_fatal is not None:
            on_fatal(f"engine start-up failed: {exc!r}")
        return
    state.server_state.ready = True
    logger.info("Warm-up done in %.1f s; ready to serve", time.perf_counter() - start)
    on_ready = getattr(state, "on_ready", None)
    if on_ready is not None:
        on_ready()
    interval = state.options.log_stats_interval
    if interval > 0:
        stats_task = asyncio.create_task(_log_stats_loop(state.stats_line, interval), name="log-stats")
        state.background_tasks.add(stats_task)


async def _log_stats_loop(stats_line: StatsLogLine, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        stats_line.maybe_log()
