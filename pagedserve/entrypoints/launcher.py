"""Serving the app: bind early, load the engines (local cores, or replicas on Ray), run uvicorn, drain on
SIGTERM, and exit non-zero when a current engine core dies. ``run_server(ServerConfig)`` is
``pagedserve serve``'s composition root.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from pagedserve import __version__
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.entrypoints.api_server import build_app
from pagedserve.entrypoints.context import ServerContext, build_context
from pagedserve.entrypoints.engine_factory import EngineFactory, LocalEngineFactory
from pagedserve.entrypoints.http_protocol import http_protocol
from pagedserve.entrypoints.server_config import ServerConfig
from pagedserve.gc_heap import freeze_heap
from pagedserve.host_resources import format_gib
from pagedserve.messages import ModelInfo
from pagedserve.tokenizer import load_tokenizer, tokenizer_path

logger = logging.getLogger("pagedserve.server")

ENGINE_DEATH_EXIT_DELAY_S = 1.0  # let in-flight 500s reach their clients before exiting


class _Server(uvicorn.Server):
    """uvicorn with a draining SIGTERM: refuse new work, let in-flight requests finish, then exit."""

    def __init__(self, config: uvicorn.Config, context: ServerContext) -> None:
        super().__init__(config)
        self.context = context
        self.shutdown_timeout = context.config.http.shutdown_timeout
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = self.context.state
        if state.draining or self._loop is None or self.shutdown_timeout <= 0:
            if state.draining:
                self.force_exit = True  # a second signal: stop waiting
            state.draining = True
            self.should_exit = True
            return
        state.draining = True
        logger.info(
            "Received %s: refusing new requests, draining in-flight ones for up to %.0f s",
            signal.Signals(sig).name,
            self.shutdown_timeout,
        )
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state = self.context.state
        context = self.context
        deadline = time.monotonic() + self.shutdown_timeout
        while time.monotonic() < deadline and (state.in_flight > 0 or context.num_unfinished_requests > 0):
            await asyncio.sleep(0.05)
        if context.num_unfinished_requests:
            logger.warning("Drain timeout: aborting %d unfinished requests", context.num_unfinished_requests)
        self.should_exit = True

    def on_engine_dead(self, error: BaseException) -> None:
        logger.error("The engine core died (%s); /health now answers 503 and the server exits", error)
        self.exit_code = 1
        if self._loop is not None:
            self._loop.call_later(ENGINE_DEATH_EXIT_DELAY_S, self._exit_now)

    def _exit_now(self) -> None:
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        # NOTE: signals are handled by serve_app through the event loop; uvicorn's own handler
        # would re-raise SIGTERM after the drain and turn a clean exit into a signal death.
        yield

    def fatal(self, message: str) -> None:
        logger.error("%s; exiting", message)
        self.exit_code = 1
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_app(app: FastAPI, context: ServerContext, sock: socket.socket) -> int:
    """Serve until SIGTERM/SIGINT (drained) or engine death; return the process exit code."""
    options = context.config.http
    config = uvicorn.Config(
        app,
        http=http_protocol(options.http_protocol),
        lifespan="on",
        log_level=options.log_level,
        access_log=options.access_log,
        h11_max_incomplete_event_size=options.max_header_bytes,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=max(1, int(min(options.shutdown_timeout, 5))),
        log_config=None,
    )
    server = _Server(config, context)
    context.on_engine_dead = server.on_engine_dead  # a current engine only (ServerContext decides)
    context.on_fatal = server.fatal
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.handle_exit, sig, None)
    try:
        await server.serve(sockets=[sock])
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    if not server.started and server.exit_code == 0:
        return 1
    return server.exit_code


def run_server(config: ServerConfig) -> int:
    """``pagedserve serve``: the composition root of the server process. Returns the exit code."""
    options = config.http
    logging.basicConfig(
        level=getattr(logging, options.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sock = bind_socket(config.host, config.port)
    load_start = time.perf_counter()
    freeze_heap("server, start-up")  # before an engine core process forks
    factory = make_engine_factory(config, close_fds=(sock.fileno(),))
    cores: list[EngineCoreClient] = []
    try:
        for spec in config.models:  # every local core forks here, before any thread of this process
            cores.append(factory.create(spec, at_startup=True))
        tokenizers = [load_tokenizer(tokenizer_path(spec.engine_config.model)) for spec in config.models]
    except BaseException:
        _shutdown_cores(cores)
        factory.close()
        raise
    context = build_context(config, factory, cores, tokenizers)
    app = build_app(context)
    url = f"http://{'[' + config.host + ']' if ':' in config.host else config.host}:{sock.getsockname()[1]}"
    default = context.registry.default
    context.on_ready = functools.partial(
        _on_ready,
        url,
        default.core.model_info,
        tuple(context.registry.served_names()),
        config,
        time.perf_counter() - load_start,
    )
    with asyncio.Runner(loop_factory=event_loop_factory(options.event_loop)) as runner:
        return runner.run(serve_app(app, context, sock))


def make_engine_factory(config: ServerConfig, close_fds: tuple[int, ...]) -> EngineFactory:
    """Local engine cores, or replicas on Ray when ``config.cluster`` is set (imported only then)."""
    if config.cluster is None:
        return LocalEngineFactory(config.engine_core, close_fds)
    from pagedserve.cluster.factory import RayEngineFactory

    return RayEngineFactory(config.cluster)


def _shutdown_cores(cores: list[EngineCoreClient]) -> None:
    """The cores built before start-up failed (none started yet)."""
    for core in cores:
        with contextlib.suppress(Exception):
            asyncio.run(core.shutdown())


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``--event-loop``: uvloop's loop (``auto``: when it is installed), or None for asyncio's own.

    uvloop (libuv) schedules callbacks and writes to sockets in C: a streamed token costs the front
    end less CPU than with asyncio's pure-Python selector loop, as in vLLM's and uvicorn's servers.
    """
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def _on_ready(url: str, info: ModelInfo, names: tuple[str, ...], config: ServerConfig, load_s: float) -> None:
    """Warmed up and serving: print the banner, then freeze what start-up left alive (``gc_heap``)."""
    _print_banner(url, info, names, config, load_s)
    freeze_heap("server, ready")


def _print_banner(url: str, info: ModelInfo, names: tuple[str, ...], config: ServerConfig, load_s: float) -> None:
    kv = (
        f"{info.num_kv_blocks} blocks x {info.block_size} tokens = {info.num_kv_blocks * info.block_size} tokens, "
        f"{format_gib(info.kv_cache_bytes)} ({info.kv_cache_reason})"
        if info.num_kv_blocks
        else "not paged (--engine hf)"
    )
    served = f"{names[0]!r}" if len(names) == 1 else f"{len(names)} names ({', '.join(map(repr, names))})"
    lines = [
        f"pagedserve {__version__} serving {served} ({info.engine_name} engine) on {url}",
        f"  OpenAI API: {url}/v1   TGI API: {url}/generate   docs: {url}/docs   metrics: {url}/metrics",
        f"  context: {info.max_model_len} tokens"
        + (f"   threads: {info.num_threads} ({info.threads_reason})" if info.num_threads else "")
        + (f"   tensor parallel: {info.tensor_parallel_size} ranks" if info.tensor_parallel_size > 1 else ""),
        f"  KV cache: {kv}",
        f"  API key: {'required' if config.http.api_keys else 'none'}   "
        f"admin API: {'on' if config.admin_key else 'off'}   "
        f"engines: {'Ray' if config.cluster is not None else 'local'}   model loaded in {load_s:.1f} s",
    ]
    spec = config.models[0].engine_config.speculative
    if spec is not None and info.engine_name == "paged":
        source = (
            f"draft model {spec.model}"
            if spec.method == "draft_model"
            else f"lookup of {spec.prompt_lookup_max}..{spec.prompt_lookup_min} tokens"
        )
        lines.append(
            f"  speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} draft tokens "
            f"({source}), off while more than {spec.disable_by_batch_size} requests run"
        )
    logger.info("\n%s", "\n".join(lines))
