"""MPEngineCoreClient: the engine-core loop (``core_loop.py``) in its own process, so HTTP handling,
detokenization and SSE in the server process never compete with the model for the GIL.

The core process is forked before the server starts any thread, or spawned (an engine loaded at run
time, or one inside a Ray actor). The loop's typed messages cross one
duplex pipe (the two ends belong to this server alone); a writer thread sends, a reader thread
receives and hands each step's outputs to the event loop as one batch.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from pagedserve import messages
from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError, build_engine
from pagedserve.engine.core_loop import ClientGone, CoreOutputReceiver, EngineCore, failure_message, run_busy_loop
from pagedserve.gc_heap import freeze_heap

logger = logging.getLogger(__name__)


class PipeChannel:
    """The loop's channel in the core process: the child's end of the pipe (closed pipe -> ClientGone)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def poll(self) -> list[messages.ClientMessage]:
        conn = self._conn
        try:
            received = []
            while conn.poll(0):
                received.append(conn.recv())
            return received
        except (EOFError, OSError) as exc:
            raise ClientGone from exc

    def wait(self, timeout: float | None = None) -> list[messages.ClientMessage]:
        try:
            if not self._conn.poll(timeout):
                return []
            first = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ClientGone from exc
        return [first, *self.poll()]

    def send(self, message: messages.CoreMessage) -> None:
        try:
            self._conn.send(message)
        except (EOFError, OSError) as exc:
            raise ClientGone from exc


EngineSpec = str | Callable[[EngineConfig], EngineCore]  # "paged" | "hf", or a builder (tests: a fake engine)


def run_engine_core(
    config: EngineConfig, conn: Connection, close_fds: tuple[int, ...] = (), engine: EngineSpec = "paged"
) -> None:
    """Body of the core process: build the engine, report ready (or why not), then run the loop."""
    # Ctrl-C, and a SIGTERM sent to the whole process group (systemd's default, `timeout`, `kill -- -PGID`),
    # reach the server too, which drains and then shuts the core down; the pipe's EOF ends it if the server dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for fd in close_fds:  # e.g. the server's listening socket, inherited through fork
        try:
            os.close(fd)
        except OSError:
            pass
    channel = PipeChannel(conn)
    try:
        core = engine(config) if callable(engine) else build_engine(config, engine)
        freeze_heap("engine core")
        ready: messages.CoreMessage = messages.CoreReady(core.model_info)
    except BaseException as exc:  # noqa: BLE001 - report any start-up failure to the parent
        core, ready = None, failure_message(exc)
    try:
        channel.send(ready)
    except ClientGone:
        return
    if core is not None:
        try:
            run_busy_loop(core, channel, on_warmed=lambda: freeze_heap("engine core, warmed up"))
        finally:
            core.shutdown()


class MPEngineCoreClient(EngineCoreClient):
    """EngineCoreClient over an engine (paged by default) in a child process (the server's default)."""

    def __init__(
        self,
        config: EngineConfig,
        engine: EngineSpec = "paged",
        close_fds: tuple[int, ...] = (),
        start_method: str = "fork",
    ) -> None:
        ctx = mp.get_context(start_method)
        if start_method != "fork":
            close_fds = ()  # a spawned child inherits no descriptors but the pipe
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(config, child_conn, tuple(close_fds), engine),
            name="pagedserve-engine-core",
            daemon=True,
        )
        self._proc.start()
        # the core ignores SIGTERM, so multiprocessing's own exit hook (terminate, then join with no
        # timeout) would wait forever for a core an error path left running: kill it first
        atexit.register(self._kill_at_exit)
        child_conn.close()
        try:
            message = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError("the engine core process exited during start-up") from None
        if isinstance(message, messages.CoreFailed):
            self._proc.join(5)
            raise RuntimeError(f"the engine core failed to start:\n{message.details}")
        assert isinstance(message, messages.CoreReady), message
        self._model_info = message.model_info
        self._receiver = CoreOutputReceiver()
        self._send_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closing = False

    # ----------------------------------------------------------------- EngineCoreClient
    @property
    def model_info(self) -> messages.ModelInfo:
        return self._model_info

    @property
    def is_dead(self) -> bool:
        return self._receiver.is_dead

    @property
    def pid(self) -> int:
        return self._proc.pid or 0

    async def warmup(self) -> None:
        self._ensure_threads()
        done = self._receiver.expect_warmup()
        self._send(messages.Warmup())
        await done

    async def start(self) -> None:
        self._ensure_threads()

    async def shutdown(self) -> None:
        self._closing = True
        if self._proc.is_alive():
            self._send(messages.Shutdown())
            await asyncio.to_thread(self._proc.join, 10)
        if self._proc.is_alive():
            self._proc.kill()
        atexit.unregister(self._kill_at_exit)
        self._send_queue.put(None)

    def _kill_at_exit(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    async def add_request(self, request: messages.EngineCoreRequest) -> None:
        self._check_alive()
        self._send(messages.AddRequest(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self._send(messages.AbortRequests(tuple(request_ids)))

    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        if samples and not self.is_dead:
            self._send(messages.StopSamples(tuple(samples)))

    async def get_outputs(self) -> list[messages.EngineCoreOutput]:
        return await self._receiver.mailbox.get()

    def get_stats(self) -> messages.SchedulerStats:
        return self._receiver.stats

    # ----------------------------------------------------------------- plumbing
    def _ensure_threads(self) -> None:
        if self._threads:
            return
        self._receiver.bind(asyncio.get_running_loop())
        for target, name in ((self._write_loop, "engine-core-writer"), (self._read_loop, "engine-core-reader")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _check_alive(self) -> None:
        if self._receiver.is_dead:
            raise self._receiver.dead_error()
        if self._closing:
            raise EngineDeadError("the engine core is shutting down")

    def _send(self, message: messages.ClientMessage) -> None:
        self._send_queue.put(message)

    def _write_loop(self) -> None:
        while (message := self._send_queue.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return

    def _read_loop(self) -> None:
        receiver = self._receiver
        try:
            while True:
                message = self._conn.recv()
                receiver.handle(message)
                if isinstance(message, messages.CoreFailed):
                    logger.error("engine core failed:\n%s", message.details)
                    return
        except (EOFError, OSError) as exc:
            if not self._closing:
                receiver.fail(messages.CoreFailed(f"the engine core process exited ({exc!r})"))


__all__ = ["MPEngineCoreClient", "PipeChannel", "run_engine_core"]
