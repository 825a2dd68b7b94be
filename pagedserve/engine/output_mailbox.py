"""OutputMailbox: EngineCoreOutputs produced on a worker thread, collected by the event loop in batches.

Shared by every EngineCoreClient whose core runs off the event loop (thread, process reader, hf).
"""

from __future__ import annotations

import asyncio
import threading

from pagedserve.engine.core_client import EngineDeadError
from pagedserve.messages import EngineCoreOutput


class OutputMailbox:
    """The worker thread calls ``put`` / ``fail``; the event loop awaits ``get``.

    Invariant: at most one wake-up callback is pending on the loop at a time (``_notify_pending``),
    so a fast producer never floods the loop with ``call_soon_threadsafe`` calls.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outputs: list[EngineCoreOutput] = []
        self._error: BaseException | None = None
        self._notify_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to the event loop that will call ``get`` (from that loop)."""
        self._loop = loop
        self._ready = asyncio.Event()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def put(self, outputs: list[EngineCoreOutput]) -> None:
        with self._lock:
            self._outputs.extend(outputs)
            notify = not self._notify_pending
            self._notify_pending = True
        if notify:
            self._wake()

    def fail(self, error: BaseException) -> None:
        """The core died: ``get`` raises EngineDeadError once the outputs already queued are taken."""
        with self._lock:
            self._error = error
            self._notify_pending = True
        self._wake()

    async def get(self) -> list[EngineCoreOutput]:
        """Wait for the next batch of outputs (at least one)."""
        assert self._ready is not None, "bind() first"
        while True:
            with self._lock:
                outputs, self._outputs = self._outputs, []
                error = self._error
                self._notify_pending = False
                self._ready.clear()
            if outputs:
                return outputs
            if error is not None:
                raise EngineDeadError(f"the engine core died: {error!r}") from error
            await self._ready.wait()

    def _wake(self) -> None:
        loop, ready = self._loop, self._ready
        if loop is None or ready is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(ready.set)
        except RuntimeError:
            pass  # the loop closed meanwhile
