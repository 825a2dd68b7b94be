"""DraftModelProposer: draft tokens from a smaller model of the target's vocabulary (the
``draft_model`` method of speculative decoding).

The draft model has its own paged KV cache (one tensor per draft layer, as many blocks as the
target's) and uses the target's block tables: the scheduler allocates one set of blocks for both,
and a request's draft K/V sits in the same slots as its target K/V. In a step where requests
draft, before the target's forward:

1. catch-up: one draft forward over the tokens each drafting request's draft has not seen yet (its
   whole prompt the first time; afterwards the one or two tokens accepted since), whose last row
   gives the first draft;
2. then one-token forwards, each on the draft before it, for the rest.

Drafts are the draft model's argmax, proposals made with certainty, so the runner's verification
keeps each with exactly the target's probability. Draft K/V written at positions whose drafts were
rejected is overwritten at the next catch-up. A request that is not drafting (prefill, a large
batch, backing off) costs the draft nothing; it catches up when it drafts again. Stale draft K/V
(a prefix block another request wrote) can only lower acceptance, never change the output.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from types import ModuleType

import torch
from torch import nn

from pagedserve.core.sched_output import DRAFT_PENDING, ScheduledRequest
from pagedserve.models.attention import build_attention_metadata
from pagedserve.worker.host_memory import kv_cache_tensors


class DraftModelProposer:
    """Owns the draft model, its KV cache and how far each sample's draft K/V is valid."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels: ModuleType | None,
        forward: Callable[..., torch.Tensor],
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len  # positions the draft can embed
        self.block_size = block_size
        self.device = device
        self.kernels = kernels
        self._forward = forward  # runs a model call and counts its time as the runner's forward time
        self.kv_caches = kv_cache_tensors(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        # per sample (Request.key): how many leading positions hold the draft K/V of the sample's tokens
        self._num_valid: dict[tuple[str, int], int] = {}

    def forget(self, keys: set[tuple[str, int]]) -> None:
        """Finished samples: their keys may be reused by new requests."""
        for key in keys:
            self._num_valid.pop(key, None)

    def propose(self, items: list[ScheduledRequest]) -> None:
        """Fill the ``DRAFT_PENDING`` slots of ``items`` with drafts. A request whose drafts would run past
        the draft model's context gets fewer (its ``num_new_tokens`` shrinks with them)."""
        for item in items:  # a sample recomputed after preemption: its draft K/V went with its blocks
            valid = self._num_valid.get(item.request.key)
            if valid is not None and item.request.num_computed_tokens < valid:
                self._num_valid[item.request.key] = item.request.num_computed_tokens
        drafting = []
        for item in items:
            if not item.spec_token_ids or item.spec_token_ids[0] != DRAFT_PENDING:
                continue
            num_known = item.request.num_tokens
            room = self.max_model_len - num_known + 1  # the last draft's own position needs no K/V
            if room < len(item.spec_token_ids):
                del item.spec_token_ids[max(room, 0) :]
                item.num_new_tokens = 1 + len(item.spec_token_ids)
            if item.spec_token_ids:
                drafting.append(item)
        if not drafting:
            return
        # each with the first position its draft has not seen; decodes first, as the attention metadata wants them
        starts = [(item, self._num_valid.get(item.request.key, 0)) for item in drafting]
        starts.sort(key=lambda pair: not (pair[0].request.num_tokens - pair[1] == 1 and pair[1] > 0))
        drafting = [item for item, _ in starts]
        ids: list[int] = []
        positions: list[int] = []
        for item, start in starts:
            ids.extend(item.request.all_token_ids[start:])
            positions.extend(range(start, item.request.num_tokens))
        num_new = [item.request.num_tokens - start for item, start in starts]
        hidden = self._run(ids, positions, [start for _, start in starts], num_new, drafting)  # [num_tokens, hidden]
        last_rows = torch.tensor(list(accumulate(num_new)), device=self.device) - 1  # [len(drafting)]
        drafts = [[token] for token in self._argmax(hidden[last_rows])]
        for step in range(1, max(len(item.spec_token_ids) for item in drafting)):
            active = [k for k, item in enumerate(drafting) if len(item.spec_token_ids) > step]
            positions = [drafting[k].request.num_tokens + step - 1 for k in active]
            hidden = self._run(
                [drafts[k][-1] for k in active], positions, positions, [1] * len(active), [drafting[k] for k in active]
            )  # [len(active), hidden]
            for k, token in zip(active, self._argmax(hidden)):
                drafts[k].append(token)
        for item, tokens in zip(drafting, drafts):
            item.spec_token_ids[:] = tokens
            self._num_valid[item.request.key] = item.request.num_tokens

    def record_accepted(self, item: ScheduledRequest, num_accepted: int) -> None:
        """After verification: the draft K/V of the accepted drafts' positions holds (the last draft's
        position never got any)."""
        key = item.request.key
        if key in self._num_valid and item.spec_token_ids:
            self._num_valid[key] += min(num_accepted, len(item.spec_token_ids) - 1)

    def _run(
        self,
        ids: list[int],
        positions: list[int],
        num_computed: list[int],
        num_new: list[int],
        items: list[ScheduledRequest],
    ) -> torch.Tensor:
        meta = build_attention_metadata(
            num_computed,
            num_new,
            [item.request.block_ids for item in items],
            self.block_size,
            self.device,
            self.kernels,
        )
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)  # [num_tokens]
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)  # [num_tokens]
        return self._forward(self.model, ids_t, pos_t, self.kv_caches, meta)  # [num_tokens, hidden]

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self._forward(self.model.compute_logits, hidden)  # [rows, vocab]
        return logits.argmax(dim=-1).tolist()
