"""The engine factory seam: ``EngineFactory.create(spec)`` builds the engine core client behind one served
model, at start-up or at run time (the admin API's loads and swaps). ``LocalEngineFactory`` builds local
cores (a child process, or a thread); the Ray factory (``pagedserve.cluster.factory``) builds replicas."""

from __future__ import annotations

from typing import Protocol

from pagedserve.config import ModelSpec
from pagedserve.engine.core_client import EngineCoreClient, make_engine_core_client


class EngineFactory(Protocol):
    """Builds engine cores for the model registry. ``create`` blocks (run-time loads call it in a thread)."""

    def create(self, spec: ModelSpec, *, at_startup: bool) -> EngineCoreClient:
        """The (not yet started) core client for ``spec``; raises if its engine cannot be built."""
        ...

    def close(self) -> None:
        """Release what the factory holds (after every core it built is shut down)."""
        ...


class LocalEngineFactory:
    """Engine cores in this machine: ``engine_core`` "process" (a child process) or "thread".

    At start-up the child is forked (before the server starts any thread; ``close_fds``, the listening
    socket, are closed in it); at run time it is spawned, since forking a threaded server is unsafe.
    ``--engine hf`` always runs in a thread of this process.
    """

    def __init__(self, engine_core: str, close_fds: tuple[int, ...] = ()) -> None:
        self.engine_core = engine_core
        self.close_fds = close_fds

    def create(self, spec: ModelSpec, *, at_startup: bool) -> EngineCoreClient:
        if spec.replicas != 1:
            raise ValueError("more than one replica needs engine replicas on Ray (--replicas or --ray-address)")
        core = "thread" if spec.engine == "hf" else self.engine_core
        return make_engine_core_client(
            spec.engine_config,
            engine=spec.engine,
            core=core,
            close_fds=self.close_fds if at_startup else (),
            start_method="fork" if at_startup else "spawn",
        )

    def close(self) -> None:
        pass
