"""AsyncLLM: the async front end of an engine core. ``generate()`` streams delta RequestOutputs.

One output-handler task pulls batches from the core client, runs the OutputProcessor
(detokenize, stop strings) and drops each request's output into its one-slot collector.
A request whose consumer goes away (CancelledError / GeneratorExit) is aborted at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable

from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError
from pagedserve.engine.output_processor import IterationStats, OutputProcessor
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, SchedulerStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import request_eos_token_ids

logger = logging.getLogger(__name__)

OUTPUT_CHUNK_SIZE = 256  # outputs processed before yielding to the event loop


class RequestOutputCollector:
    """A one-slot mailbox per request: a newer delta is merged into an unread one."""

    __slots__ = ("_output", "_ready")

    def __init__(self) -> None:
        self._output: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        current = self._output
        if current is None or isinstance(output, BaseException):
            self._output = output
            self._ready.set()
        elif isinstance(current, RequestOutput):
            current.merge_delta(output)

    async def get(self) -> RequestOutput:
        while self._output is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self._output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self._output = self._output, None
        self._ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


class AsyncLLM:
    """Front end of one engine core: request registry, output handler task, stats hooks."""

    def __init__(
        self, core: EngineCoreClient, tokenizer, stat_observers: list[Callable[[IterationStats], None]] | None = None
    ) -> None:
        self.core = core
        self.model_info: ModelInfo = core.model_info
        self.tokenizer = tokenizer  # the front end's (HF fast tokenizer); the engine works in token ids
        # empty (the model's own EOS ids) unless the tokenizer's EOS is not among them (sent with each request)
        self._eos_token_ids = request_eos_token_ids(self.model_info.eos_token_ids, tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self.stat_observers = list(stat_observers or [])
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._handler_task: asyncio.Task | None = None
        self._dead_error: BaseException | None = None
        self._dead_callbacks: list[Callable[[BaseException], None]] = []

    # ----------------------------------------------------------------- lifecycle
    async def warmup(self) -> None:
        """A real forward pass in the engine core before serving; call before ``start``."""
        await self.core.warmup()

    async def start(self) -> None:
        await self.core.start()
        if self._handler_task is None:
            self._handler_task = asyncio.create_task(self._run_output_handler(), name="output-handler")

    async def shutdown(self) -> None:
        task, self._handler_task = self._handler_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for request_id in list(self._collectors):
            await self.abort(request_id)
        await self.core.shutdown()

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` once if the engine core dies."""
        self._dead_callbacks.append(callback)

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None or self.core.is_dead

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._collectors)

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    # ----------------------------------------------------------------- requests
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield delta RequestOutputs until the request finishes; abort it if the caller goes away.

        The request was checked by the caller (the serving layer); raises ValueError for a request id
        already in flight (``OutputProcessor.add_request``, the one place it is checked), EngineDeadError if
        the core died.
        """
        if self.is_dead:
            raise EngineDeadError("the engine core is dead")
        arrival_time = time.monotonic()
        collector = RequestOutputCollector()
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, arrival_time, cumulative=False)
        self._collectors[request_id] = collector
        request = EngineCoreRequest(
            request_id, prompt_token_ids, params, arrival_time, priority, self._eos_token_ids, cache_salt
        )
        finished = False
        try:
            await self.core.add_request(request)
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                await self.abort(request_id)
            raise
        except BaseException:
            if not finished:
                await self.abort(request_id)
            raise
        finally:
            self._collectors.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request: forget it here and free its KV blocks in the core.

        A consumer still waiting in ``generate()`` gets a final, empty ``finished`` output.
        """
        collector = self._collectors.pop(request_id, None)
        final = self.output_processor.abort_request(request_id)
        if final is not None:
            self._emit_stats()
            if collector is not None:
                collector.put(final)
        if not self.core.is_dead:
            await self.core.abort_requests([request_id])

    # ----------------------------------------------------------------- output handler
    async def _run_output_handler(self) -> None:
        core = self.core
        processor = self.output_processor
        collectors = self._collectors
        try:
            while True:
                # a request can fail alone: its grammar did not compile, or (cluster) every replica tried failed
                outputs = self._fail_requests_in(await core.get_outputs())
                for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
                    if start:
                        await asyncio.sleep(0)
                    processed = processor.process_outputs(outputs[start : start + OUTPUT_CHUNK_SIZE])
                    for request_output in processed.request_outputs:
                        collector = collectors.get(request_output.request_id)
                        if collector is not None:
                            collector.put(request_output)
                    if processed.samples_to_stop:
                        await core.stop_samples(processed.samples_to_stop)
                self._emit_stats()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the core is gone; fail every request
            self._fail_all(exc)

    def _fail_requests_in(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """End the requests that ``outputs`` report failed with EngineDeadError; return the other outputs."""
        if all(output.error is None for output in outputs):
            return outputs
        kept = []
        for output in outputs:
            if output.error is None:
                kept.append(output)
                continue
            collector = self._collectors.pop(output.request_id, None)
            if self.output_processor.abort_request(output.request_id) is not None:
                self._emit_stats()
            if collector is not None:
                collector.put(EngineDeadError(output.error))
        return kept

    def _emit_stats(self) -> None:
        stats = self.output_processor.take_iteration_stats()
        if stats.is_empty:
            return
        for observer in self.stat_observers:
            observer(stats)

    def _fail_all(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine core died: {exc!r}")
        if not isinstance(exc, EngineDeadError):
            logger.exception("output handler failed", exc_info=exc)
        self._dead_error = error
        for collector in list(self._collectors.values()):
            collector.put(error)
        for callback in self._dead_callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001
                logger.exception("engine-dead callback failed")


__all__ = ["AsyncLLM", "RequestOutputCollector"]
