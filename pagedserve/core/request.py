"""Request: the engine's state for one sample of one request (token ids, progress, KV blocks)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.outputs import FinishReason, TokenLogprob
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Request:
    """One sequence the scheduler runs. A request with ``n > 1`` starts as sample 0 and is
    forked into samples ``1..n-1`` once its prompt is computed; forks share the prompt's blocks.

    Invariants: ``num_computed_tokens <= num_tokens``; tokens ``[0, num_computed_tokens)`` have
    their K/V in ``block_ids`` (``len(block_ids) * block_size >= num_computed_tokens``).

    Pure data, no tensors: a seeded sample's random generator lives in the model runner, keyed by
    ``key`` (sample ``i`` seeded with ``sampling_params.seed + i``).
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...]
    priority: int = 0
    cache_salt: str | None = None  # prefix-cache hits only among requests with the same salt
    num_samples_to_fork: int = 1  # > 1 only for sample 0 of an n > 1 request before its fork
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit when first scheduled
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the full blocks, in order
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    first_output_sent: bool = False
    # speculative decoding back-off: steps left without drafts, and the length of the last back-off
    # (doubled each time a whole draft is rejected, reset when one is accepted)
    spec_skip_steps: int = 0
    spec_backoff: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def fork(self, index: int) -> Request:
        """A new sample that shares this one's progress; the caller shares the blocks (ref counts)."""
        params = self.sampling_params
        return Request(
            request_id=self.request_id,
            index=index,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=params,
            arrival_time=self.arrival_time,
            eos_token_ids=self.eos_token_ids,
            priority=self.priority,
            cache_salt=self.cache_salt,
            all_token_ids=list(self.prompt_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            block_ids=list(self.block_ids),
            block_hashes=list(self.block_hashes),
            num_registered_blocks=self.num_registered_blocks,
            status=self.status,
            first_scheduled_time=self.first_scheduled_time,
            prompt_logprobs_sent=True,
        )
