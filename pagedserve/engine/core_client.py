"""EngineCoreClient: the one interface the async front end uses to reach an engine core.

Implementations: the paged engine running its step loop in a background thread
(``ThreadedEngineCoreClient``) and the one-request-at-a-time Transformers baseline
(``HFEngineCoreClient``, ``--engine hf``). Swapping the core swaps the engine; the HTTP
front end and the output processing stay the same.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.engine.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, SchedulerStats


class EngineDeadError(RuntimeError):
    """The engine core has stopped and will not produce any more outputs."""


class EngineCoreClient(ABC):
    """Async handle on an engine core. All methods are called from one event loop."""

    @abstractmethod
    async def start(self) -> None:
        """Start the core (thread, process); returns once it accepts requests."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the core; pending requests are dropped."""

    @abstractmethod
    async def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request; its outputs arrive through ``get_outputs``."""

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
        """The served model's name, limits, EOS ids and tokenizer (available before ``start``)."""

    @property
    @abstractmethod
    def is_dead(self) -> bool:
        """True once the core has failed."""
