"""The engine-core loop: one busy loop driving a synchronous engine, in a thread or in a forked process.

Engine side (``run_busy_loop``): apply the client's messages in the order they were sent, ``step()``
while the engine has work, send each step's outputs as one message (with a stats snapshot at most
every ``STATS_INTERVAL_S``), send a snapshot and block when going idle (no spinning; the engine's
``check_health`` runs every ``HEALTH_CHECK_INTERVAL_S`` meanwhile, so a dead tensor-parallel worker
is found without a request), report a fatal error once and stop. The engine is anything with LLMEngine's synchronous surface (``EngineCore``):
the paged ``LLMEngine`` or the Transformers baseline ``HFEngine``.

Client side (``CoreOutputReceiver``): what the event loop's client keeps of the core's messages: the
OutputMailbox (a whole step's outputs handed over as one batch, one pending wake-up), the latest
stats snapshot, the warm-up waiter, and the death of the core (every waiter fails, ``get_outputs``
raises EngineDeadError once the queued outputs are taken).

``ThreadChannel`` connects the two within one process (``ThreadedEngineCoreClient``); the process
client (``mp_client.py``) carries the same messages over a pipe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

from pagedserve.engine.core_client import EngineDeadError
from pagedserve.engine.output_mailbox import OutputMailbox
from pagedserve.messages import (
    AbortRequests,
    AddRequest,
    ClientMessage,
    CoreFailed,
    CoreMessage,
    CoreOutputs,
    CoreReady,
    CoreStats,
    EngineCoreOutput,
    EngineCoreRequest,
    ModelInfo,
    SchedulerStats,
    Shutdown,
    StopSamples,
    Warmup,
    WarmupDone,
)

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # refresh the stats snapshot at most this often while busy
HEALTH_CHECK_INTERVAL_S = 1.0  # an idle engine's health is checked this often


class EngineCore(Protocol):
    """The synchronous engine surface the loop drives (LLMEngine, HFEngine). One caller at a time."""

    model_info: ModelInfo

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def stop_samples(self, samples: list[tuple[str, int]]) -> None: ...
    def step(self) -> list[EngineCoreOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_stats(self) -> SchedulerStats: ...
    def warmup(self) -> None: ...
    def check_health(self) -> None:
        """Raise if the engine can no longer serve (e.g. a worker process died); cheap."""

    def shutdown(self) -> None:
        """Release what the engine started (worker processes); called once, after the loop ends."""


class CoreChannel(Protocol):
    """The engine side of a client connection."""

    def poll(self) -> list[ClientMessage]:
        """Every message queued now (maybe none), in the order sent; never blocks."""

    def wait(self, timeout: float | None = None) -> list[ClientMessage]:
        """At least one message, blocking until one arrives; none if ``timeout`` seconds pass first."""

    def send(self, message: CoreMessage) -> None:
        """Deliver a message to the client."""


class ClientGone(Exception):
    """The client's end of the channel closed: the loop ends quietly."""


def failure_message(exc: BaseException) -> CoreFailed:
    return CoreFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc())


def run_busy_loop(engine: EngineCore, channel: CoreChannel, *, on_warmed: Callable[[], None] | None = None) -> None:
    """Drive ``engine`` until a ``Shutdown`` message, the client going away, or a failure (sent once)."""
    last_stats = time.monotonic()
    try:
        while True:
            if engine.has_unfinished_requests():
                messages = channel.poll()
            else:  # going idle: a fresh snapshot, then sleep until the client sends something
                channel.send(CoreStats(engine.get_stats()))
                while not (messages := channel.wait(HEALTH_CHECK_INTERVAL_S)):
                    engine.check_health()
                last_stats = time.monotonic()
            if messages and _apply(engine, channel, messages, on_warmed):
                return
            if engine.has_unfinished_requests():
                outputs = engine.step()
                now = time.monotonic()
                stats = None
                if now - last_stats >= STATS_INTERVAL_S:
                    stats, last_stats = engine.get_stats(), now
                if outputs or stats is not None:
                    channel.send(CoreOutputs(outputs, stats))
    except ClientGone:
        return
    except BaseException as exc:  # noqa: BLE001 - any failure kills the core; the client reports it
        failure = failure_message(exc)
        logger.error("engine core failed; no more requests can be served\n%s", failure.details)
        try:
            channel.send(failure)
        except ClientGone:
            pass


def _apply(
    engine: EngineCore, channel: CoreChannel, messages: list[ClientMessage], on_warmed: Callable[[], None] | None
) -> bool:
    """Apply the messages in order; True on Shutdown (the ones after it are dropped)."""
    for message in messages:
        kind = type(message)
        if kind is AddRequest:
            engine.add_request(message.request)
        elif kind is AbortRequests:
            engine.abort_requests(message.request_ids)
        elif kind is StopSamples:
            engine.stop_samples(message.samples)
        elif kind is Warmup:
            engine.warmup()
            if on_warmed is not None:
                on_warmed()
            channel.send(WarmupDone())
        elif kind is Shutdown:
            return True
        else:
            raise TypeError(f"unknown engine-core message {message!r}")
    return False


class ThreadChannel:
    """The loop's channel when it runs in a thread of the client's process: a locked input list and an
    Event (set on every put) in; the client's ``CoreOutputReceiver`` called directly out."""

    def __init__(self, receiver: CoreOutputReceiver) -> None:
        self._receiver = receiver
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inputs: list[ClientMessage] = []

    def put(self, message: ClientMessage) -> None:
        """From the event loop."""
        with self._lock:
            self._inputs.append(message)
        self._wakeup.set()

    def poll(self) -> list[ClientMessage]:
        with self._lock:
            messages, self._inputs = self._inputs, []
        return messages

    def wait(self, timeout: float | None = None) -> list[ClientMessage]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._wakeup.clear()
            with self._lock:
                messages, self._inputs = self._inputs, []
            if messages:
                return messages
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return []
            self._wakeup.wait(left)

    def send(self, message: CoreMessage) -> None:
        self._receiver.handle(message)


class CoreOutputReceiver:
    """The client's side of the core's messages. ``handle`` runs on a thread off the event loop (the
    engine thread, or the process client's reader thread); the event loop awaits ``mailbox.get()`` and
    ``expect_warmup()``."""

    def __init__(self) -> None:
        self.mailbox = OutputMailbox()
        self.stats = SchedulerStats()
        self.model_info: ModelInfo | None = None  # from CoreReady (process core)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warmups: list[asyncio.Future] = []  # touched on the event loop only
        self._failure: CoreFailed | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.mailbox.bind(loop)

    @property
    def failure(self) -> CoreFailed | None:
        return self._failure

    @property
    def is_dead(self) -> bool:
        return self._failure is not None

    def dead_error(self) -> EngineDeadError:
        failure = self._failure
        return EngineDeadError(f"the engine core died: {failure.error if failure else 'unknown error'}")

    def handle(self, message: CoreMessage) -> None:
        kind = type(message)
        if kind is CoreOutputs:
            if message.stats is not None:
                self.stats = message.stats
            if message.outputs:
                self.mailbox.put(message.outputs)
        elif kind is CoreStats:
            self.stats = message.stats
        elif kind is WarmupDone:
            self._call_soon(self._resolve_warmup, None)
        elif kind is CoreFailed:
            self.fail(message)
        elif kind is CoreReady:
            self.model_info = message.model_info
        else:
            raise TypeError(f"unknown engine-core message {message!r}")

    def fail(self, failure: CoreFailed) -> None:
        """The core died (reported once): fail the mailbox and every waiter."""
        if self._failure is not None:
            return
        self._failure = failure
        self.mailbox.fail(RuntimeError(failure.error))
        self._call_soon(self._resolve_warmup, self.dead_error())

    def expect_warmup(self) -> asyncio.Future:
        """On the event loop, before sending Warmup: a future set by the next WarmupDone (EngineDeadError
        if the core dies first)."""
        future = self._loop.create_future()
        if self._failure is not None:
            future.set_exception(self.dead_error())
        else:
            self._warmups.append(future)
        return future

    def _resolve_warmup(self, error: BaseException | None) -> None:
        count = len(self._warmups) if error is not None else 1
        waiters, self._warmups = self._warmups[:count], self._warmups[count:]
        for future in waiters:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _call_soon(self, callback: Callable, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the loop closed meanwhile


__all__ = [
    "HEALTH_CHECK_INTERVAL_S",
    "STATS_INTERVAL_S",
    "ClientGone",
    "CoreChannel",
    "CoreOutputReceiver",
    "EngineCore",
    "ThreadChannel",
    "failure_message",
    "run_busy_loop",
]
