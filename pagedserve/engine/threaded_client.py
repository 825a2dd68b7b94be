"""ThreadedEngineCoreClient: runs LLMEngine's step loop in a background thread of the server process.

The event loop talks to the thread through a locked input list (add / abort / stop) and gets
each step's outputs as one batch; the thread sleeps on an Event while there is nothing to do.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING

from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError
from pagedserve.engine.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, SchedulerStats
from pagedserve.engine.output_mailbox import OutputMailbox

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_ADD, _ABORT, _STOP = 0, 1, 2
STATS_INTERVAL_S = 0.25  # refresh the stats snapshot at most this often while busy


class ThreadedEngineCoreClient(EngineCoreClient):
    """EngineCoreClient over an in-process LLMEngine driven by one background thread.

    Invariants: only the engine thread touches the engine (after ``start``); the event loop only
    swaps the ``_inputs`` list under ``_lock``; outputs reach the loop through an OutputMailbox.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._model_info = engine.model_info
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inputs: list[tuple[int, object, asyncio.Future | None]] = []
        self._mailbox = OutputMailbox()
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = SchedulerStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._applying: list[asyncio.Future] = []  # futures of the batch being applied (engine thread)

    # ----------------------------------------------------------------- EngineCoreClient
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    @property
    def dtype(self) -> str | None:
        dtype = getattr(self._engine, "dtype", None)
        return str(dtype).removeprefix("torch.") if dtype is not None else None

    async def warmup(self) -> None:
        """A real forward pass before serving (first-call costs); call before ``start``."""
        if self._thread is None and hasattr(self._engine, "warmup"):
            await asyncio.to_thread(self._engine.warmup)

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._mailbox.bind(self._loop)
        self._stats = self._engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            pending = [fut for _, _, fut in self._inputs if fut is not None]
            self._inputs = []
        self._wakeup.set()
        for fut in pending:
            if not fut.done():
                fut.set_exception(EngineDeadError("the engine is shutting down"))
        if self._thread is not None and self._thread is not threading.current_thread():
            await asyncio.to_thread(self._thread.join, 30.0)

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; returns once the engine accepted it (ValueError if it refused it)."""
        self._check_alive()
        future = self._loop.create_future()
        self._put(_ADD, request, future)
        await future

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self._put(_ABORT, list(request_ids), None)

    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        if samples and not self.is_dead:
            self._put(_STOP, list(samples), None)

    async def get_outputs(self) -> list[EngineCoreOutput]:
        return await self._mailbox.get()

    def get_stats(self) -> SchedulerStats:
        return self._stats

    # ----------------------------------------------------------------- event-loop side helpers
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine core died: {self._error!r}")
        if self._stopping or self._thread is None:
            raise EngineDeadError("the engine core is not running")

    def _put(self, kind: int, payload: object, future: asyncio.Future | None) -> None:
        with self._lock:
            self._inputs.append((kind, payload, future))
        self._wakeup.set()

    def _resolve(self, results: list[tuple[asyncio.Future, BaseException | None]]) -> None:
        for future, error in results:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self._engine
        last_stats = time.monotonic()
        try:
            while True:
                with self._lock:
                    inputs, self._inputs = self._inputs, []
                    stopping = self._stopping
                if stopping:
                    return
                if inputs:
                    self._apply_inputs(inputs)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        self._push_outputs(outputs)
                    now = time.monotonic()
                    if now - last_stats >= STATS_INTERVAL_S:
                        self._stats, last_stats = engine.get_stats(), now
                    continue
                self._stats, last_stats = engine.get_stats(), time.monotonic()
                self._wakeup.wait()
                self._wakeup.clear()
        except BaseException as exc:  # noqa: BLE001 - any failure kills the core
            logger.exception("engine core failed; no more requests can be served")
            self._die(exc)

    def _apply_inputs(self, inputs: list[tuple[int, object, asyncio.Future | None]]) -> None:
        engine = self._engine
        results: list[tuple[asyncio.Future, BaseException | None]] = []
        self._applying = [future for _, _, future in inputs if future is not None]
        for kind, payload, future in inputs:
            if kind == _ADD:
                try:
                    engine.add_request(payload)  # type: ignore[arg-type]
                except ValueError as exc:
                    results.append((future, exc))
                else:
                    results.append((future, None))
            elif kind == _ABORT:
                engine.abort_requests(payload)  # type: ignore[arg-type]
            else:
                engine.stop_samples(payload)  # type: ignore[arg-type]
        self._applying = []
        if results:
            self._loop.call_soon_threadsafe(self._resolve, results)

    def _push_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self._mailbox.put(outputs)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
            futures = self._applying + [fut for _, _, fut in self._inputs if fut is not None]
            pending = [(fut, EngineDeadError(f"the engine core died: {exc!r}")) for fut in futures]
            self._inputs = []
        self._mailbox.fail(exc)
        loop = self._loop
        if not pending or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._resolve, pending)
        except RuntimeError:
            pass  # the loop closed meanwhile


__all__ = ["ThreadedEngineCoreClient"]
