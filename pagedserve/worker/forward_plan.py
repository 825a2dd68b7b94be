"""ForwardPlan: one step's model work in plain lists, everything a rank needs to run its part of the
forward: which blocks to copy, the flat token batch, the attention layout, and which rows' logits
are taken.

The leader's ModelRunner builds it from a SchedulerOutput; under tensor parallelism it is sent to
every other rank, which runs the same forward (the layers' collectives pair up because every rank
runs the same calls on the same shapes) and leaves sampling to the leader.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ForwardPlan:
    block_copies: list[tuple[int, int]]  # (source block, destination block): copy-on-write, before the forward
    input_ids: list[int]  # [num_tokens]
    positions: list[int]  # [num_tokens]
    num_computed_tokens: list[int]  # per request: tokens already in the cache
    num_new_tokens: list[int]  # per request: tokens in this step (drafts included)
    block_ids: list[list[int]]  # per request: its block table
    sample_rows: list[int]  # flat token index of each row whose logits are sampled, in order
    # (request index, first row, rows): rows whose logits give prompt logprobs
    prompt_logit_rows: list[tuple[int, int, int]] = field(default_factory=list)


__all__ = ["ForwardPlan"]
