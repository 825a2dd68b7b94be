"""EngineCoreClient: the one interface the async front end uses to reach an engine core.

An engine core is a synchronous engine (``LLMEngine``, or ``HFEngine`` for ``--engine hf``) driven by
the engine-core loop (``core_loop.py``) in a background thread of this process
(``ThreadedEngineCoreClient``) or in a forked process (``MPEngineCoreClient``).
``make_engine_core_client`` builds one; swapping the engine or the core leaves the front end as it is.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from pagedserve.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, ReplicaStatus, SchedulerStats

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig

ENGINES = ("paged", "hf")
CORES = ("process", "thread")


class EngineDeadError(RuntimeError):
    """The engine core has stopped and will not produce any more outputs."""


class EngineCapacityError(RuntimeError):
    """There is no room for the engine asked for: the CPUs or GPUs its replicas need are taken."""


class EngineCoreClient(ABC):
    """Async handle on an engine core. All methods are called from one event loop."""

    @abstractmethod
    async def warmup(self) -> None:
        """A real forward pass in the core (first-call costs); call before ``start``."""

    @abstractmethod
    async def start(self) -> None:
        """Start the core (thread, process); returns once it accepts requests."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the core; pending requests are dropped."""

    @abstractmethod
    async def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end has checked; its outputs arrive through ``get_outputs``.

        No round trip: messages reach the core in the order they were sent (an abort after it applies after it).
        """

    @abstractmethod
    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort whole requests (every sample); their KV blocks are freed at once."""

    @abstractmethod
    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        """Finish single samples ``(request_id, index)``, e.g. when the front end matched a stop string."""

    @abstractmethod
    async def get_outputs(self) -> list[EngineCoreOutput]:
        """Wait for the next batch of outputs (at least one). Raises EngineDeadError if the core died."""

    @abstractmethod
    def get_stats(self) -> SchedulerStats:
        """A recent snapshot of queue lengths, KV usage and cumulative counters."""

    @property
    @abstractmethod
    def model_info(self) -> ModelInfo:
        """The served model's name, limits, EOS ids and dtype (available before ``start``)."""

    @property
    @abstractmethod
    def is_dead(self) -> bool:
        """True once the core has failed."""

    @property
    def pid(self) -> int:
        """The process the engine steps in."""
        return os.getpid()

    def replica_statuses(self) -> list[ReplicaStatus]:
        """The engine replicas behind this client: one for a local core, one per replica on a cluster."""
        return [ReplicaStatus("0", self.pid, socket.gethostname(), self.get_stats())]


def build_engine(config: EngineConfig, engine: str = "paged"):
    """The synchronous engine ``engine`` names: ``LLMEngine`` ("paged") or ``HFEngine`` ("hf")."""
    if engine == "paged":
        from pagedserve.engine.llm_engine import LLMEngine

        return LLMEngine(config)
    if engine == "hf":
        from pagedserve.engine.hf_core import HFEngine

        return HFEngine(config)
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")


def make_engine_core_client(
    config: EngineConfig,
    *,
    engine: str = "paged",
    core: str = "process",
    close_fds: tuple[int, ...] = (),
    start_method: str = "fork",
) -> EngineCoreClient:
    """Build the engine ``engine`` ("paged" | "hf") and its core ``core`` ("process" | "thread").

    "process" starts the core process at once: ``start_method`` "fork" (call it before starting any
    thread; ``close_fds``, e.g. the server's listening socket, are closed in the child) or "spawn" (a
    fresh interpreter: safe from a process that already runs threads, e.g. an engine loaded at run time
    or inside a Ray actor); "thread" builds the engine in this process. Blocks until the engine is built.
    Raises RuntimeError (process) or the engine's own error (thread) if the engine cannot be built.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    if core == "process":
        from pagedserve.engine.mp_client import MPEngineCoreClient

        return MPEngineCoreClient(config, engine=engine, close_fds=close_fds, start_method=start_method)
    if core == "thread":
        from pagedserve.engine.threaded_client import ThreadedEngineCoreClient

        return ThreadedEngineCoreClient(build_engine(config, engine))
    raise ValueError(f"core must be one of {', '.join(CORES)}; got {core!r}")


__all__ = ["EngineCoreClient", "EngineDeadError", "build_engine", "make_engine_core_client"]
