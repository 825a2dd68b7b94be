"""OutputProcessor: engine-core outputs (token ids) -> RequestOutputs (text, logprobs, finish reasons).

Runs in the front end, synchronously and engine-agnostic: incremental detokenization, stop
strings (the caller tells the engine to stop the matched samples), request timing, and the
per-iteration counters that feed the metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.messages import EngineCoreOutput
from pagedserve.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput, TokenLogprob
from pagedserve.sampling_params import SamplingParams


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished (or aborted) request, for the end-to-end metrics."""

    finish_reason: FinishReason
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    n: int
    max_tokens: int | None
    # vLLM's phases: scheduled -> first token (prefill), first -> last token (decode), scheduled -> last token
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    time_per_output_token: float | None = None  # decode time / (the longest sample's tokens - 1)


@dataclass(slots=True)
class IterationStats:
    """Counters gathered while processing outputs since the last ``take_iteration_stats``."""

    num_prompt_tokens: int = 0  # of requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.num_generation_tokens or self.finished_requests or self.time_to_first_tokens)


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    samples_to_stop: list[tuple[str, int]]  # (request_id, index) whose stop string matched


@dataclass(slots=True)
class _SampleState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # delta mode: tokens (and logprobs) already handed out
    last_token_time: float = 0.0
    changed: bool = False


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cumulative: bool
    samples: list[_SampleState]
    metrics: RequestMetrics
    num_unfinished: int
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0


class OutputProcessor:
    """Holds the front-end state of every live request. Not thread-safe: one caller at a time."""

    def __init__(self, tokenizer: object, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats  # False: counters are not kept (offline use never takes them)
        self._requests: dict[str, _RequestState] = {}
        self._stats = IterationStats()

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        cumulative: bool,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = [
            _SampleState(
                index=i,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        self._requests[request_id] = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            cumulative=cumulative,
            samples=samples,
            metrics=RequestMetrics(arrival_time=arrival_time),
            num_unfinished=params.n,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request (the caller aborts it in the engine).

        Returns its final output (unfinished samples end with ``FinishReason.ABORT``), or None if
        the request was not live.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        now = time.monotonic()
        state.metrics.finished_time = now
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = FinishReason.ABORT
                sample.changed = True
        self._record_finished(state, FinishReason.ABORT, now)
        return self._make_request_output(state, finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def take_iteration_stats(self) -> IterationStats:
        stats, self._stats = self._stats, IterationStats()
        return stats

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        if not self.log_stats:
            self._stats = IterationStats()
        changed: dict[str, _RequestState] = {}
        samples_to_stop: list[tuple[str, int]] = []
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None or output.index >= len(state.samples):
                continue  # aborted, or every sample already finished
            sample = state.samples[output.index]
            if sample.finish_reason is not None:
                continue  # stopped by a stop string; the engine has not heard yet
            self._update_request(state, output, now)
            if self._update_sample(state, sample, output, now):
                samples_to_stop.append((state.request_id, sample.index))
            changed[state.request_id] = state
        request_outputs = []
        for state in changed.values():
            finished = state.num_unfinished == 0
            if finished:
                state.metrics.finished_time = now
                del self._requests[state.request_id]
                self._record_finished(state, None, now)
            request_outputs.append(self._make_request_output(state, finished))
        return ProcessedOutputs(request_outputs, samples_to_stop)

    # ----------------------------------------------------------------- internals
    def _update_request(self, state: _RequestState, output: EngineCoreOutput, now: float) -> None:
        metrics = state.metrics
        if output.first_scheduled_time is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = output.first_scheduled_time
        if output.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = output.prompt_logprobs
        if output.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = output.num_cached_tokens
        if output.new_token_ids and metrics.first_token_time is None:
            metrics.first_token_time = now
            self._stats.num_prompt_tokens += len(state.prompt_token_ids)
            self._stats.time_to_first_tokens.append(now - metrics.arrival_time)

    def _update_sample(self, state: _RequestState, sample: _SampleState, output: EngineCoreOutput, now: float) -> bool:
        """Apply one output to a sample; True if a stop string finished it (the engine must be told)."""
        new_ids = output.new_token_ids
        if new_ids:
            if sample.token_ids:
                self._stats.inter_token_latencies.append(now - sample.last_token_time)
            sample.last_token_time = now
            sample.token_ids.extend(new_ids)
            self._stats.num_generation_tokens += len(new_ids)
            if sample.logprobs is not None and output.new_logprobs:
                sample.logprobs.extend(output.new_logprobs)
        sample.changed = True
        reason = output.finish_reason
        stop_terminated = reason is FinishReason.STOP and not isinstance(output.stop_reason, str)
        stop_str = sample.detokenizer.update(new_ids, stop_terminated)
        if stop_str is None and reason is not None:
            stop_str = sample.detokenizer.finish()
        if stop_str is not None:
            sample.finish_reason, sample.stop_reason = FinishReason.STOP, stop_str
        elif reason is not None:
            sample.finish_reason, sample.stop_reason = reason, output.stop_reason
        else:
            return False
        state.num_unfinished -= 1
        return reason is None

    def _make_request_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        completions = []
        for sample in state.samples:
            if state.cumulative:
                completions.append(self._cumulative_output(sample))
            elif sample.changed:
                completions.append(self._delta_output(sample))
            sample.changed = False
        prompt_logprobs = state.prompt_logprobs
        if not state.cumulative:
            if state.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )

    @staticmethod
    def _cumulative_output(sample: _SampleState) -> CompletionOutput:
        finished = sample.finish_reason is not None
        return CompletionOutput(
            index=sample.index,
            text=sample.detokenizer.get_next_output_text(finished, delta=False),
            token_ids=list(sample.token_ids),
            logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    @staticmethod
    def _delta_output(sample: _SampleState) -> CompletionOutput:
        finished = sample.finish_reason is not None
        start = sample.num_sent_tokens
        sample.num_sent_tokens = len(sample.token_ids)
        return CompletionOutput(
            index=sample.index,
            text=sample.detokenizer.get_next_output_text(finished, delta=True),
            token_ids=sample.token_ids[start:],
            logprobs=sample.logprobs[start:] if sample.logprobs is not None else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _record_finished(self, state: _RequestState, reason: FinishReason | None, now: float) -> None:
        if reason is None:
            # The request's reason: that of its first sample (n > 1 rarely differs).
            reason = state.samples[0].finish_reason or FinishReason.STOP
        metrics = state.metrics
        scheduled, first_token = metrics.first_scheduled_time, metrics.first_token_time
        last_token = max(s.last_token_time for s in state.samples) if first_token is not None else None
        decode = None if last_token is None else last_token - first_token
        longest = max(len(s.token_ids) for s in state.samples)
        self._stats.finished_requests.append(
            FinishedRequestStats(
                finish_reason=reason,
                e2e_latency=now - metrics.arrival_time,
                queue_time=metrics.queue_time,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=sum(len(s.token_ids) for s in state.samples),
                n=state.params.n,
                max_tokens=state.params.max_tokens,
                prefill_time=None if first_token is None or scheduled is None else first_token - scheduled,
                decode_time=decode,
                inference_time=None if last_token is None or scheduled is None else last_token - scheduled,
                time_per_output_token=None if decode is None or longest < 2 else decode / (longest - 1),
            )
        )
