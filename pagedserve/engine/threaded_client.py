"""ThreadedEngineCoreClient: the engine-core loop (``core_loop.py``) in a background thread of this process.

Used for ``--engine-core thread`` and, by default, for the Transformers baseline (``--engine hf``).
The event loop puts typed messages on a ``ThreadChannel``; the engine thread hands outputs, stats and
failures straight to a ``CoreOutputReceiver``.
"""

from __future__ import annotations

import asyncio
import threading

from pagedserve import messages
from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError
from pagedserve.engine.core_loop import CoreOutputReceiver, EngineCore, ThreadChannel, run_busy_loop


class ThreadedEngineCoreClient(EngineCoreClient):
    """EngineCoreClient over an in-process engine (LLMEngine, HFEngine) driven by one background thread.

    Invariant: once the thread runs (``warmup`` or ``start``), only it touches the engine.
    """

    def __init__(self, engine: EngineCore) -> None:
        self._engine = engine
        self._model_info = engine.model_info
        self._receiver = CoreOutputReceiver()
        self._channel = ThreadChannel(self._receiver)
        self._thread: threading.Thread | None = None
        self._closing = False

    # ----------------------------------------------------------------- EngineCoreClient
    @property
    def model_info(self) -> messages.ModelInfo:
        return self._model_info

    @property
    def is_dead(self) -> bool:
        return self._receiver.is_dead

    @property
    def engine(self) -> EngineCore:
        return self._engine

    async def warmup(self) -> None:
        self._ensure_started()
        done = self._receiver.expect_warmup()
        self._channel.put(messages.Warmup())
        await done

    async def start(self) -> None:
        self._ensure_started()

    async def shutdown(self) -> None:
        self._closing = True
        self._channel.put(messages.Shutdown())
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            await asyncio.to_thread(thread.join, 30.0)
        self._engine.shutdown()

    async def add_request(self, request: messages.EngineCoreRequest) -> None:
        self._check_alive()
        self._channel.put(messages.AddRequest(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self._channel.put(messages.AbortRequests(tuple(request_ids)))

    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        if samples and not self.is_dead:
            self._channel.put(messages.StopSamples(tuple(samples)))

    async def get_outputs(self) -> list[messages.EngineCoreOutput]:
        return await self._receiver.mailbox.get()

    def get_stats(self) -> messages.SchedulerStats:
        return self._receiver.stats

    # ----------------------------------------------------------------- plumbing
    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        self._receiver.bind(asyncio.get_running_loop())
        self._receiver.stats = self._engine.get_stats()
        self._thread = threading.Thread(
            target=run_busy_loop, args=(self._engine, self._channel), name="engine-core", daemon=True
        )
        self._thread.start()

    def _check_alive(self) -> None:
        if self._receiver.is_dead:
            raise self._receiver.dead_error()
        if self._closing or self._thread is None:
            raise EngineDeadError("the engine core is not running")


__all__ = ["ThreadedEngineCoreClient"]
