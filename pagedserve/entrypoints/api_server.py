"""The HTTP app: ``build_app(context)`` = the OpenAI, TGI and admin routes, the server's own routes (health,
version, load, metrics), the web pages and offline API docs, middleware (in the order
docs/middleware.md lists), error handlers, and a lifespan that warms up and starts every model's engine,
and shuts them all down at the end (``launcher.run_server`` serves it)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.responses import PlainTextResponse, Response
from starlette.staticfiles import StaticFiles

from pagedserve import __version__
from pagedserve.entrypoints.admin.routes import router as admin_router
from pagedserve.entrypoints.context import ServerContext, get_context
from pagedserve.entrypoints.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RateLimitMiddleware,
    ServerStateMiddleware,
    StreamStallMiddleware,
    TimingMiddleware,
    TrustedHostMiddleware,
    is_guarded_path,
)
from pagedserve.entrypoints.model_registry import ModelRegistry
from pagedserve.entrypoints.model_serving import READY
from pagedserve.entrypoints.openai.routes import router as openai_router
from pagedserve.entrypoints.serving.errors import install_error_handlers, json_response
from pagedserve.entrypoints.serving.openapi import error_responses, install_openapi
from pagedserve.entrypoints.tgi.routes import router as tgi_router
from pagedserve.entrypoints.web.api_docs import add_api_docs
from pagedserve.entrypoints.web.routes import STATIC_DIR, UI_PREFIX
from pagedserve.entrypoints.web.routes import router as web_router
from pagedserve.metrics import CONTENT_TYPE

logger = logging.getLogger("pagedserve.server")

router = APIRouter()
_HEALTH = {200: {"description": "Ready: every model serves"}, **error_responses((503,), tgi=True)}


@router.get("/health", response_class=Response, responses=_HEALTH)
@router.get("/ping", response_class=Response, responses=_HEALTH)
async def health(raw_request: Request) -> Response:
    """200 only when every model is ready and its current engine alive, and the server is not draining."""
    context = get_context(raw_request)
    servings = context.registry.servings()
    dead = [serving.name for serving in servings if serving.engine.is_dead]
    if dead:
        return json_response(
            {"error": f"unhealthy: the engine core of {', '.join(dead)} died", "error_type": "healthcheck"}, 503
        )
    if context.state.draining:
        return json_response({"error": "unhealthy: shutting down", "error_type": "healthcheck"}, 503)
    if not context.state.ready or any(serving.state != READY for serving in servings):
        return json_response({"error": "not ready: warming up", "error_type": "healthcheck"}, 503)
    return Response(status_code=200)


@router.get("/version")
async def show_version() -> Response:
    return json_response({"version": __version__})


@router.get("/load")
async def show_load(raw_request: Request) -> Response:
    return json_response({"server_load": get_context(raw_request).num_unfinished_requests})


@router.get("/metrics", response_class=PlainTextResponse, responses=error_responses((401,)))
async def metrics(raw_request: Request) -> Response:
    return Response(get_context(raw_request).metrics.render(), media_type=CONTENT_TYPE)


def build_app(context: ServerContext) -> FastAPI:
    """The FastAPI app over the context's (not yet started) engine. Its lifespan warms up and starts it."""
    app = FastAPI(
        title="pagedserve",
        version=__version__,
        lifespan=_lifespan,
        description="OpenAI- and TGI-compatible LLM inference server",
        docs_url=None,  # served from local assets by add_api_docs
        redoc_url=None,
    )
    add_api_docs(app)
    if context.config.http.web_ui:
        app.include_router(web_router)
        app.mount(UI_PREFIX + "/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
    app.include_router(openai_router)
    app.include_router(tgi_router)
    app.include_router(admin_router)
    app.include_router(router)
    install_error_handlers(app)
    options = context.config.http
    install_openapi(
        app,
        guarded=is_guarded_path,
        api_keys=bool(options.api_keys),
        admin_key=context.config.admin_key is not None,
        metrics_key=options.protect_metrics and bool(options.api_keys),
    )
    app.state.context = context
    _add_middleware(app, context)
    return app


def _add_middleware(app: FastAPI, context: ServerContext) -> None:
    """Outermost first: the user's --middleware (the last given first), TrustedHost, CORS, GZip, request
    id and timing, server state, body limit, API keys, rate limit."""
    options = context.config.http
    # NOTE: add_middleware wraps the app, so the last added runs first (outermost).
    if options.rate_limit:
        limit, period = options.rate_limit
        app.add_middleware(RateLimitMiddleware, limit=limit, period_s=period, on_reject=context.metrics.record_rejected)
    if options.api_keys:
        also_guarded = frozenset({"/metrics"}) if options.protect_metrics else frozenset()
        app.add_middleware(APIKeyMiddleware, api_keys=list(options.api_keys), also_guarded=also_guarded)
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_bytes)
    if options.stream_stall_timeout is not None:
        app.add_middleware(
            StreamStallMiddleware,
            stall_timeout_s=options.stream_stall_timeout,
            on_abort=context.metrics.record_slow_client,
        )
    app.add_middleware(ServerStateMiddleware, state=context.state)
    app.add_middleware(TimingMiddleware)
    if options.gzip_min_bytes > 0:  # NOTE: Starlette's GZip passes text/event-stream through unbuffered
        app.add_middleware(GZipMiddleware, minimum_size=options.gzip_min_bytes)
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_credentials=options.allow_credentials,
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers),
        )
    if options.allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(options.allowed_hosts))
    for path in options.middleware:
        add_user_middleware(app, path)


def add_user_middleware(app: FastAPI, path: str) -> None:
    """``--middleware module.Name``: a class is added as ASGI middleware (``app.add_middleware``), an async
    function ``(request, call_next)`` as an http middleware; anything else is a start-up error."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name:
        raise ValueError(f"--middleware {path!r}: expected module.Name")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--middleware {path!r}: cannot import it ({exc})") from exc
    if inspect.isclass(target):
        app.add_middleware(target)
    elif inspect.iscoroutinefunction(target):
        app.middleware("http")(target)
    else:
        raise ValueError(f"--middleware {path!r}: expected an ASGI middleware class or an async function")


@asynccontextmanager
async def _lifespan(app: FastAPI):
    context: ServerContext = app.state.context
    context.spawn(_start_engines(context), name="engine-start")
    try:
        yield
    finally:
        for background in list(context.background_tasks):
            background.cancel()
        await asyncio.gather(*context.background_tasks, return_exceptions=True)
        servings = context.registry.servings() + context.registry.retiring()
        await asyncio.gather(*(serving.shutdown() for serving in servings), return_exceptions=True)
        await asyncio.to_thread(context.factory.close)


async def _start_engines(context: ServerContext) -> None:
    servings = context.registry.servings()
    start = time.perf_counter()
    try:
        await asyncio.gather(*(serving.start() for serving in servings))
    except Exception as exc:  # noqa: BLE001 - a server that cannot start must exit non-zero
        logger.exception("engine start-up failed")
        if context.on_fatal is not None:
            context.on_fatal(f"engine start-up failed: {exc!r}")
        return
    for serving in servings:
        serving.state = READY
    context.state.ready = True
    context.spawn(context.live_stats.run(), name="live-stats")
    logger.info("Warm-up done in %.1f s; ready to serve", time.perf_counter() - start)
    if context.on_ready is not None:
        context.on_ready()
    interval = context.config.http.log_stats_interval
    if interval > 0:
        context.spawn(_log_stats_loop(context.registry, interval), name="log-stats")


async def _log_stats_loop(registry: ModelRegistry, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for serving in registry.servings():
            serving.stats_line.maybe_log()
