"""MPEngineCoreClient: LLMEngine's step loop in its own process, so HTTP handling, detokenization
and SSE in the server process never compete with the model for the GIL.

The core process is forked before the server starts any thread. Requests, aborts and outputs
cross one duplex pipe (the two ends belong to this server alone); a writer thread sends, a reader
thread receives and hands each step's outputs to the event loop as one batch.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError
from pagedserve.engine.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, SchedulerStats
from pagedserve.engine.output_mailbox import OutputMailbox
from pagedserve.gc_heap import freeze_heap

logger = logging.getLogger(__name__)

# messages to the core
_ADD, _ABORT, _STOP, _WARMUP, _SHUTDOWN = "add", "abort", "stop", "warmup", "shutdown"
# messages from the core
_READY, _ADDED, _OUTPUTS, _STATS, _WARMED, _FAILED = "ready", "added", "outputs", "stats", "warmed", "failed"
STATS_INTERVAL_S = 0.25


def run_engine_core(config: EngineConfig, conn: Connection, close_fds: tuple[int, ...] = ()) -> None:
    """Body of the core process: build the engine, then step while there is work."""
    from pagedserve.engine.llm_engine import LLMEngine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which shuts the core down
    for fd in close_fds:  # e.g. the server's listening socket, inherited through fork
        try:
            os.close(fd)
        except OSError:
            pass

    try:
        engine = LLMEngine(config)
        freeze_heap("engine core")
        conn.send((_READY, engine.model_info, str(engine.dtype).removeprefix("torch.")))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        conn.send((_FAILED, traceback.format_exc()))
        return
    last_stats = 0.0
    try:
        while True:
            busy = engine.has_unfinished_requests()
            if not busy:
                conn.send((_STATS, engine.get_stats()))
            if not busy or conn.poll(0):
                if _handle_inputs(engine, conn, block=not busy):
                    return
            if engine.has_unfinished_requests():
                outputs = engine.step()
                now = time.monotonic()
                stats = None
                if now - last_stats >= STATS_INTERVAL_S:
                    stats, last_stats = engine.get_stats(), now
                if outputs or stats is not None:
                    conn.send((_OUTPUTS, outputs, stats))
    except (EOFError, BrokenPipeError, OSError):
        return  # the server went away
    except BaseException:  # noqa: BLE001 - any failure kills the core; the server reports it
        message = traceback.format_exc()
        logger.error("engine core failed; no more requests can be served\n%s", message)
        try:
            conn.send((_FAILED, message))
        except OSError:
            pass


def _handle_inputs(engine, conn: Connection, block: bool) -> bool:
    """Apply every queued message (waiting for one if ``block``); True on shutdown."""
    while block or conn.poll(0):
        block = False
        kind, payload = conn.recv()
        if kind == _ADD:
            try:
                engine.add_request(payload)
            except ValueError as exc:
                conn.send((_ADDED, payload.request_id, str(exc)))
            else:
                conn.send((_ADDED, payload.request_id, None))
        elif kind == _ABORT:
            engine.abort_requests(payload)
        elif kind == _STOP:
            engine.stop_samples(payload)
        elif kind == _WARMUP:
            engine.warmup()
            freeze_heap("engine core, warmed up")
            conn.send((_WARMED, None))
        elif kind == _SHUTDOWN:
            return True
    return False


class MPEngineCoreClient(EngineCoreClient):
    """EngineCoreClient over an LLMEngine in a child process (the server's default)."""

    def __init__(self, config: EngineConfig, close_fds: tuple[int, ...] = ()) -> None:
        ctx = mp.get_context("fork")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=run_engine_core, args=(config, child_conn, tuple(close_fds)), name="pagedserve-engine-core", daemon=True
        )
        self._proc.start()
        child_conn.close()
        try:
            message = self._conn.recv()
        except EOFError:
            raise RuntimeError("the engine core process exited during start-up") from None
        if message[0] == _FAILED:
            self._proc.join(5)
            raise RuntimeError(f"the engine core failed to start:\n{message[1]}")
        _, self._model_info, self.dtype = message
        self._stats = SchedulerStats()
        self._mailbox = OutputMailbox()
        self._pending_adds: dict[str, asyncio.Future] = {}
        self._warmed: asyncio.Future | None = None
        self._send_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._closing = False

    # ----------------------------------------------------------------- EngineCoreClient
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def is_dead(self) -> bool:
        return self._mailbox.error is not None

    async def warmup(self) -> None:
        """A real forward pass in the core before serving; call before ``start``."""
        await self._ensure_threads()
        self._warmed = self._loop.create_future()
        self._send((_WARMUP, None))
        await self._warmed

    async def start(self) -> None:
        await self._ensure_threads()

    async def shutdown(self) -> None:
        self._closing = True
        if self._proc.is_alive():
            self._send((_SHUTDOWN, None))
            await asyncio.to_thread(self._proc.join, 10)
        if self._proc.is_alive():
            self._proc.kill()
        self._send_queue.put(None)

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        future = self._loop.create_future()
        self._pending_adds[request.request_id] = future
        self._send((_ADD, request))
        try:
            await future
        finally:
            self._pending_adds.pop(request.request_id, None)

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self._send((_ABORT, list(request_ids)))

    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        if samples and not self.is_dead:
            self._send((_STOP, list(samples)))

    async def get_outputs(self) -> list[EngineCoreOutput]:
        return await self._mailbox.get()

    def get_stats(self) -> SchedulerStats:
        return self._stats

    # ----------------------------------------------------------------- plumbing
    async def _ensure_threads(self) -> None:
        if self._threads:
            return
        self._loop = asyncio.get_running_loop()
        self._mailbox.bind(self._loop)
        for target, name in ((self._write_loop, "engine-core-writer"), (self._read_loop, "engine-core-reader")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _check_alive(self) -> None:
        if self._mailbox.error is not None:
            raise EngineDeadError(f"the engine core died: {self._mailbox.error}")
        if self._closing:
            raise EngineDeadError("the engine core is shutting down")

    def _send(self, message: tuple) -> None:
        self._send_queue.put(message)

    def _write_loop(self) -> None:
        while (message := self._send_queue.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return

    def _read_loop(self) -> None:
        loop = self._loop
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == _OUTPUTS:
                    outputs, stats = rest
                    if stats is not None:
                        self._stats = stats
                    if outputs:
                        self._mailbox.put(outputs)
                elif kind == _STATS:
                    self._stats = rest[0]
                elif kind == _ADDED:
                    loop.call_soon_threadsafe(self._resolve_add, rest[0], rest[1])
                elif kind == _WARMED:
                    loop.call_soon_threadsafe(_set_result, self._warmed)
                elif kind == _FAILED:
                    self._die(RuntimeError(rest[0].strip().splitlines()[-1] if rest[0].strip() else "engine failure"), rest[0])
                    return
        except (EOFError, OSError) as exc:
            if not self._closing:
                self._die(RuntimeError(f"the engine core process exited ({exc!r})"), "")

    def _resolve_add(self, request_id: str, error: str | None) -> None:
        future = self._pending_adds.get(request_id)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(ValueError(error))

    def _die(self, error: BaseException, details: str) -> None:
        if details:
            logger.error("engine core failed:\n%s", details)
        self._mailbox.fail(error)
        loop = self._loop

        def fail_waiters() -> None:
            dead = EngineDeadError(f"the engine core died: {error}")
            for future in list(self._pending_adds.values()) + ([self._warmed] if self._warmed else []):
                if not future.done():
                    future.set_exception(dead)

        try:
            loop.call_soon_threadsafe(fail_waiters)
        except RuntimeError:
            pass  # the loop closed meanwhile


def _set_result(future: asyncio.Future | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


__all__ = ["MPEngineCoreClient", "run_engine_core"]
