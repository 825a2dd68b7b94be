"""ServerContext: the server-wide part of the HTTP layer (config, metrics, server state, the model registry,
the engine factory, background tasks, the launcher's hooks), built once by ``build_context``; routes reach
it with ``get_context`` (it is the only thing on ``app.state``) and pick a model's ModelServing from its
registry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from pagedserve.config import ModelSpec
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.entrypoints.admin.service import AdminService
from pagedserve.entrypoints.engine_factory import EngineFactory
from pagedserve.entrypoints.middleware import ServerState
from pagedserve.entrypoints.model_registry import ModelRegistry
from pagedserve.entrypoints.model_serving import DRAINING, FAILED, ModelServing, build_model_serving
from pagedserve.entrypoints.server_config import ServerConfig
from pagedserve.entrypoints.web.live_stats import LiveStats
from pagedserve.metrics import Metrics

logger = logging.getLogger("pagedserve.server")


@dataclass(slots=True)
class ServerContext:
    """One server's HTTP layer. ``on_ready`` / ``on_fatal`` / ``on_engine_dead`` are the launcher's hooks:
    start-up done, start-up failed, a *current* engine died (not one draining or failing to load)."""

    config: ServerConfig
    metrics: Metrics
    state: ServerState
    registry: ModelRegistry
    factory: EngineFactory
    admin: AdminService | None = None  # set by build_context
    live_stats: LiveStats | None = None  # set by build_context
    background_tasks: set[asyncio.Task] = field(default_factory=set)
    on_ready: Callable[[], None] | None = None
    on_fatal: Callable[[str], None] | None = None
    on_engine_dead: Callable[[BaseException], None] | None = None

    def new_serving(
        self, spec: ModelSpec, names: tuple[str, ...], core: EngineCoreClient, tokenizer: Any
    ) -> ModelServing:
        """A ModelServing of ``spec`` over ``core`` (not started), watched for engine death."""
        return build_model_serving(self.config, spec, names, core, tokenizer, self.metrics, on_dead=self._engine_died)

    def _engine_died(self, serving: ModelServing, error: BaseException) -> None:
        if serving.state != DRAINING:
            serving.state = FAILED
        if self.registry.is_current(serving) and self.on_engine_dead is not None:
            self.on_engine_dead(error)
        else:
            logger.warning("model %r: an engine that is not serving died (%s)", serving.name, error)

    def engine_sources(self) -> Iterator[tuple[str, EngineCoreClient]]:
        """(name, core) of every model's current engine: what /metrics reads at scrape time."""
        return ((serving.name, serving.core) for serving in self.registry.servings())

    @property
    def num_unfinished_requests(self) -> int:
        """Requests in every engine, current and draining."""
        servings = self.registry.servings() + self.registry.retiring()
        return sum(serving.engine.num_unfinished_requests for serving in servings)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run ``coro`` in the background; cancelled (and awaited) when the app stops."""
        task = asyncio.create_task(coro, name=name)
        self.background_tasks.add(task)
        task.add_done_callback(self.background_tasks.discard)
        return task


def get_context(request: Request) -> ServerContext:
    """The context of the app serving ``request``."""
    return request.app.state.context


def build_context(
    config: ServerConfig, factory: EngineFactory, cores: list[EngineCoreClient], tokenizers: list[Any]
) -> ServerContext:
    """The HTTP layer over the start-up engine cores of ``config.models`` (one each, not started: the app's
    lifespan starts them), every model registered with the state ``loading``."""
    registry = ModelRegistry()
    metrics = Metrics(config.default_model.name, lambda: context.engine_sources())
    context = ServerContext(config=config, metrics=metrics, state=ServerState(), registry=registry, factory=factory)
    for spec, core, tokenizer in zip(config.models, cores, tokenizers, strict=True):
        registry.add(context.new_serving(spec, config.names_of(spec), core, tokenizer))
    context.admin = AdminService(context)
    context.live_stats = LiveStats(metrics, context.engine_sources)
    return context
