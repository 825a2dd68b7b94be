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
from collections.abc import Sequence

from pagedserve.core.block_pool import KVBlock
from pagedserve.core.request import Request

# (tokens held now, tokens still expected, 1 if it grows by one token per step else 0): a request's
# sample, or a block that several requests share
Entry = tuple[int, int, int]

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

    def entries(self, request: Request, num_shared_tokens: int = 0) -> list[Entry]:
        """The entries of a request about to start: ``num_shared_tokens`` leading tokens sit in blocks
        running requests hold (prefix hits), and each of the ``n - 1`` samples it forks into adds its
        own copy of the partly filled last block and its own output."""
        expected = self.expected_output(request)
        entries = [(max(0, request.num_tokens - num_shared_tokens), expected, 1)]
        entries += [(request.num_tokens % self.block_size, expected, 1)] * (request.num_samples_to_fork - 1)
        return entries

    def running_entries(self, running: list[Request], blocks: Sequence[KVBlock]) -> list[Entry]:
        """The entries of the running requests with every physical block counted once: a block several
        of them share (forks of one prompt, prefix hits) is an entry of its own that does not grow and
        lasts as long as the holder expected to run longest."""
        bs = self.block_size
        entries: list[Entry] = []
        shared: dict[int, int] = {}  # block id -> the longest expected output among its holders
        for request in running:
            shared_here = [block_id for block_id in request.block_ids if blocks[block_id].ref_cnt > 1]
            own = self.entries(request, len(shared_here) * bs)
            expected = own[0][1]
            for block_id in shared_here:
                if shared.get(block_id, -1) < expected:
                    shared[block_id] = expected
            entries += own
        entries += [(bs, expected, 0) for expected in shared.values()]
        return entries

    def peak_blocks(self, entries: list[Entry]) -> float:
        """The most blocks held at once from now until the last entry ends, if each growing entry adds
        one token per step until its expected output is done and every entry is freed when it ends.

        Usage peaks just before some entry ends: at step ``t = r_j`` the entries still held are those
        with ``r_i >= r_j``, each holding ``c_i`` tokens plus ``t`` if it grows, so the peak is the
        largest ``sum(c_i) + g * r_j`` over the entries with the largest remaining counts, ``g`` of them
        growing. Each growing entry's partly filled last block counts as half a block (the mean over
        request lengths).
        """
        if not entries:
            return 0.0
        bs = self.block_size
        peak = sum(c + g * bs / 2 for c, _, g in entries) / bs  # now (t = 0)
        tokens = growing = 0
        for c, r, g in sorted(entries, key=lambda e: e[1], reverse=True):
            tokens += c
            growing += g
            peak = max(peak, (tokens + growing * r) / bs + growing / 2)
        return peak

    def record_finished(self, request: Request) -> None:
        """Learn from a request that ended by stop or length: the share of its output budget it used."""
        budget = self.output_budget_left(request) + request.num_output_tokens  # the budget at its start
        if budget <= 0:
            return
        used = min(1.0, request.num_output_tokens / budget)
        self.output_ratio += OUTPUT_RATIO_SMOOTHING * (used - self.output_ratio)
        self.output_ratio = max(MIN_OUTPUT_RATIO, self.output_ratio)

    def record_preemption(self) -> None:
        """A step ran out of blocks despite the estimate: reserve more from now on."""
        self.output_ratio = min(1.0, self.output_ratio + PREEMPTION_RATIO_STEP)
