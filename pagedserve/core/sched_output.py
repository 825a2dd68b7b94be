"""The scheduler <-> model-runner contract for one step: what to run, and what came back."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.request import Request
from pagedserve.outputs import TokenLogprob

DRAFT_PENDING = -1  # a draft slot left for the runner's draft model, which writes the token in before the forward


@dataclass(slots=True)
class ScheduledRequest:
    """Run ``num_new_tokens`` tokens of ``request`` starting at ``request.num_computed_tokens``.

    ``num_samples`` is 0 for a prefill chunk that does not reach the end of the known tokens,
    ``n`` at the fork point of an ``n > 1`` request, else 1.

    ``spec_token_ids``: draft tokens (speculative decoding) run after the request's last token, so
    ``num_new_tokens`` is ``1 + len(spec_token_ids)``; the runner samples at all those positions and
    returns the accepted drafts plus one token of its own. With a draft model the scheduler leaves
    ``DRAFT_PENDING`` slots here, and the runner's drafter fills them in before the target's forward.
    """

    request: Request
    num_new_tokens: int
    num_samples: int
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.request.num_computed_tokens > 0

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits this request takes in the step: one per sample, or one per verified position."""
        return len(self.spec_token_ids) + 1 if self.spec_token_ids else self.num_samples


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work. ``finished_req_ids``: the keys ``(request_id, index)`` of the samples that
    finished (stopped, aborted) since the previous non-empty output, so that the runner drops their
    per-sample state (a seeded sample's generator) before this step, where a key may be reused."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    num_batched_tokens: int = 0
    finished_req_ids: set[tuple[str, int]] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request, in the same order: sampled tokens (0, 1 or n; for a request with drafts, the
    accepted drafts and one more) and logprobs when asked (one per token)."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob] | None]
    prompt_logprobs: list[list[TokenLogprob | None] | None]
