"""The HTTP app: ``build_app(context)`` = the OpenAI and TGI routes, the server's own routes (health,
version, load, metrics), middleware, error handlers, and a lifespan that warms up and starts the engine
(``launcher.run_server`` serves it)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from pagedserve import __version__
from pagedserve.entrypoints.context import ServerContext, get_context
from pagedserve.entrypoints.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RateLimitMiddleware,
    ServerStateMiddleware,
    TimingMiddleware,
)
from pagedserve.entrypoints.openai.routes import router as openai_router
from pagedserve.entrypoints.serving.errors import install_error_handlers, json_response
from pagedserve.entrypoints.tgi.routes import router as tgi_router
from pagedserve.metrics import CONTENT_TYPE, StatsLogLine

logger = logging.getLogger("pagedserve.server")

router = APIRouter()


@router.get("/health")
@router.get("/ping")
async def health(raw_request: Request) -> Response:
    context = get_context(raw_request)
    if context.engine.is_dead:
        return json_response({"error": "unhealthy: the engine core died", "error_type": "healthcheck"}, 503)
    if context.state.draining:
        return json_response({"error": "unhealthy: shutting down", "error_type": "healthcheck"}, 503)
    if not context.state.ready:
        return json_response({"error": "not ready: warming up", "error_type": "healthcheck"}, 503)
    return Response(status_code=200)


@router.get("/version")
async def show_version() -> Response:
    return json_response({"version": __version__})


@router.get("/load")
async def show_load(raw_request: Request) -> Response:
    return json_response({"server_load": get_context(raw_request).engine.num_unfinished_requests})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(get_context(raw_request).metrics.render(), media_type=CONTENT_TYPE)


def build_app(context: ServerContext) -> FastAPI:
    """The FastAPI app over the context's (not yet started) engine. Its lifespan warms up and starts it."""
    app = FastAPI(
        title="pagedserve",
        version=__version__,
        lifespan=_lifespan,
        description="OpenAI- and TGI-compatible LLM inference server",
    )
    app.include_router(openai_router)
    app.include_router(tgi_router)
    app.include_router(router)
    install_error_handlers(app)
    app.state.context = context
    _add_middleware(app, context)
    return app


def _add_middleware(app: FastAPI, context: ServerContext) -> None:
    options = context.config.http
    # NOTE: add_middleware wraps the app, so the last added runs first (outermost).
    if options.rate_limit:
        limit, period = options.rate_limit
        app.add_middleware(RateLimitMiddleware, limit=limit, period_s=period, on_reject=context.metrics.record_rejected)
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=list(options.api_keys))
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_bytes)
    app.add_middleware(ServerStateMiddleware, state=context.state)
    app.add_middleware(TimingMiddleware)
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_credentials=options.allow_credentials,
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers),
        )


@asynccontextmanager
async def _lifespan(app: FastAPI):
    context: ServerContext = app.state.context
    task = asyncio.create_task(_start_engine(context), name="engine-start")
    context.background_tasks.add(task)
    try:
        yield
    finally:
        for background in list(context.background_tasks):
            background.cancel()
        await asyncio.gather(*context.background_tasks, return_exceptions=True)
        await context.engine.shutdown()


async def _start_engine(context: ServerContext) -> None:
    engine = context.engine
    start = time.perf_counter()
    try:
        await engine.warmup()
        await engine.start()
    except Exception as exc:  # noqa: BLE001 - a server that cannot start must exit non-zero
        logger.exception("engine start-up failed")
        if context.on_fatal is not None:
            context.on_fatal(f"engine start-up failed: {exc!r}")
        return
    context.state.ready = True
    logger.info("Warm-up done in %.1f s; ready to serve", time.perf_counter() - start)
    if context.on_ready is not None:
        context.on_ready()
    interval = context.config.http.log_stats_interval
    if interval > 0:
        stats_task = asyncio.create_task(_log_stats_loop(context.stats_line, interval), name="log-stats")
        context.background_tasks.add(stats_task)


async def _log_stats_loop(stats_line: StatsLogLine, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        stats_line.maybe_log()
