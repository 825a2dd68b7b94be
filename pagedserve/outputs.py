"""Results handed to callers: RequestOutput / CompletionOutput, token logprobs, finish reasons."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """Why a sequence stopped. ``STOP`` covers EOS, stop token ids and stop strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one chosen token, its rank in the distribution, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)  # [(token_id, logprob)] best first


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request.

    In the offline API the fields are cumulative; the async front end yields deltas
    (``text``/``token_ids``/``logprobs`` hold only what is new since the previous output).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic / perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced: the prompt, one CompletionOutput per sample, timing."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    def merge_delta(self, new: RequestOutput) -> None:
        """Fold a later delta output of the same request into this one (text, tokens, logprobs appended)."""
        by_index = {c.index: c for c in self.outputs}
        for completion in new.outputs:
            old = by_index.get(completion.index)
            if old is None:
                self.outputs.append(completion)
                by_index[completion.index] = completion
                continue
            old.text += completion.text
            old.token_ids = old.token_ids + completion.token_ids
            if completion.logprobs is not None:
                old.logprobs = (old.logprobs or []) + completion.logprobs
            old.finish_reason = completion.finish_reason
            old.stop_reason = completion.stop_reason
        self.finished = new.finished
        self.metrics = new.metrics
        self.num_cached_tokens = max(self.num_cached_tokens, new.num_cached_tokens)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = new.prompt_logprobs
