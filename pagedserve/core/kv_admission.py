"""KVAdmission: the lookahead admission test (``kv_admission="lookahead"``) and what it learns.

A prompt that fits in the free blocks *now* can still run the cache out later, when the running
requests' outputs have grown; the scheduler then preempts the newest request, and under a full
cache that repeats while streams stall. The lookahead test starts a waiting request only if the
*peak* of the blocks held by the running requests and by it, as they grow and finish, fits in the
cache (usage peaks just before some request finishes, so requests about to finish count only
until they do, not as whole reservations).

A request's expected growth is ``output_ratio`` of the output it may still produce (``max_tokens``
left, capped by the context). ``output_ratio`` is learnt: each request that ends by stop or length
moves it towards the share of its output budget it used, and each step that had to preempt raises
it. With traffic that uses whole budgets it converges on 1 (exact peaks, no preemption); with
chat traffic that stops early it settles on the share actually used.
"""

from __future__ import annotations

import math

from pagedserve.core.request import Request

INITIAL_OUTPUT_RATIO = 0.5  # before any request has finished: half of each output budget
MIN_OUTPUT_RATIO = 0.05
OUTPUT_RATIO_SMOOTHING = 0.05  # weight of one finished request in the moving average
PREEMPTION_RATIO_STEP = 0.1  # added to the ratio by each step that preempted


class KVAdmission:
    """Expected KV blocks of requests, and the admission test built on them."""

    def __init__(self, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.output_ratio = INITIAL_OUTPUT_RATIO

    def output_budget_left(self, request: Request) -> int:
        """Tokens the request may still append (its ``max_tokens`` left, within the context)."""
        left = self.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - request.num_output_tokens)
        return max(0, left)

    def expected_output(self, request: Request) -> int:
        """Output tokens the request is still expected to produce."""
        return math.ceil(self.output_budget_left(request) * self.output_ratio)

    def entries(self, request: Request, num_shared_tokens: int = 0) -> list[tuple[int, int]]:
        """``(tokens it holds or will hold now, tokens still expected)`` per sample of the request;
        ``num_shared_tokens`` leading tokens sit in blocks another request holds (prefix hits)."""
        entry = (request.num_tokens - num_shared_tokens, self.expected_output(request))
        return [entry] * request.num_samples_to_fork

    def peak_blocks(self, entries: list[tuple[int, int]]) -> float:
        """The most blocks these requests hold at once from now until the last finishes, if each
        produces its expected output one token per step and frees its blocks when done.

        Usage peaks just before some request finishes: at step ``t = r_j`` the requests still running
        are those with ``r_i >= r_j``, each holding ``c_i + t`` tokens, so the peak is the largest
        ``sum(c_i) + k * r_j`` over the ``k`` requests with the largest remaining counts. Each request's
        partly filled last block counts as half a block (the mean over request lengths).
        """
        if not entries:
            return 0.0
        bs = self.block_size
        peak = sum(c for c, _ in entries) / bs + len(entries) / 2  # now (t = 0)
        tokens = 0
        for k, (c, r) in enumerate(sorted(entries, key=lambda e: e[1], reverse=True), start=1):
            tokens += c
            peak = max(peak, (tokens + k * r) / bs + k / 2)
        return peak

    def record_finished(self, request: Request) -> None:
        """Learn from a request that ended by stop or length: the share of its output budget it used."""
        budget = self.max_model_len - request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        if budget <= 0:
            return
        used = min(1.0, request.num_output_tokens / budget)
        self.output_ratio += OUTPUT_RATIO_SMOOTHING * (used - self.output_ratio)
        self.output_ratio = max(MIN_OUTPUT_RATIO, self.output_ratio)

    def record_preemption(self) -> None:
        """A step ran out of blocks despite the estimate: reserve more from now on."""
        self.output_ratio = min(1.0, self.output_ratio + PREEMPTION_RATIO_STEP)
