"""Scheduler: continuous batching over a token budget, chunked prefill, preemption by recompute.

There is no separate prefill or decode phase. Each request knows ``num_computed_tokens`` and
``num_tokens``; each step spends the token budget on RUNNING requests first (one decode token
each, or the next chunk of a prompt), then admits WAITING ones. A prompt that does not fit in
what is left of the budget is prefilled in chunks over several steps. When the KV cache runs
out, the newest (or, under the priority policy, the least important) running request is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed.
Waiting requests are admitted in order. With ``kv_admission="lookahead"`` they are admitted only
while the cache can hold what they and the running requests are still expected to need
(``KVAdmission``), so a full cache makes requests wait for space instead of preempting one another.

With speculative decoding, a decoding request may run its last token plus draft tokens (prompt
lookup) in one step: the drafts count against the token budget and take KV slots; the runner
returns the drafts the model agreed with plus one token of its own, and the slots of rejected
drafts are simply overwritten later (their blocks stay with the request for its next tokens).
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from pagedserve.config import SchedulerConfig, SpeculativeConfig
from pagedserve.core.kv_admission import KVAdmission
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.ngram_proposer import NgramProposer
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched_output import DRAFT_PENDING, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedserve.messages import ITERATION_TOKEN_BUCKETS, EngineCoreOutput, SchedulerStats
from pagedserve.outputs import FinishReason

MAX_SPEC_BACKOFF_STEPS = 32  # longest pause in drafting for a request whose drafts keep being rejected


class Scheduler:
    """Owns the waiting queue, the running list and every live sample (``requests``)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.speculative = speculative
        # drafts by prompt lookup here; a draft model's are made by the runner, in the slots left for them
        self.proposer = (
            NgramProposer(
                speculative.prompt_lookup_min, speculative.prompt_lookup_max, speculative.num_speculative_tokens
            )
            if speculative is not None and speculative.method == "ngram"
            else None
        )
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.admission = KVAdmission(kv_cache.block_size, max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, list[Request]] = {}
        # keys of the samples finished since the last non-empty SchedulerOutput, which carries them to the
        # runner (its per-sample state: seeded generators). A preempted sample is not finished: it keeps its
        # generator's state across the recompute, so its later tokens are those it would have drawn anyway.
        self.finished_req_ids: set[tuple[str, int]] = set()
        # cumulative counters: num_preemptions, num_prompt_tokens, num_generation_tokens, num_steps and
        # the step-token histogram (_iteration_token_counts, _iteration_tokens_sum)
        self.reset_counters()

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"request id {request.request_id!r} in flight"
        self.requests[request.request_id] = [request]
        if self.config.policy == "priority":
            position = len(self.waiting)
            for i, other in enumerate(self.waiting):
                if (request.priority, request.arrival_time) < (other.priority, other.arrival_time):
                    position = i
                    break
            self.waiting.insert(position, request)
        else:
            self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for request in self.requests.get(request_id, [])[:]:
                self._finish(request, FinishReason.ABORT, None)

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        for request_id, index in samples:
            for request in self.requests.get(request_id, [])[:]:
                if request.index == index:
                    self.admission.record_finished(request)
                    self._finish(request, FinishReason.STOP, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        now = time.monotonic()

        speculate = self.speculative is not None and len(self.running) <= self.speculative.disable_by_batch_size
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_left = request.num_tokens - request.num_computed_tokens
            num_new = min(num_left, budget)
            if not self.config.enable_chunked_prefill and num_new < num_left:
                i += 1
                continue
            drafts = self._propose(request, budget) if speculate and num_left == 1 else []
            num_new += len(drafts)
            preempted_here = False
            while not self.kv_cache.allocate_slots(request, num_new):
                if drafts:  # no room for the drafts: run the plain decode before preempting anyone
                    drafts, num_new = [], num_new - len(drafts)
                    continue
                victim = self._pick_victim()
                budget += self._unschedule(scheduled, victim)
                self._preempt(victim)
                preempted = preempted_here = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; the list shifted under index i
            scheduled.append(ScheduledRequest(request, num_new, self._num_samples(request, num_new), drafts))
            budget -= num_new
            i = self.running.index(request) + 1 if preempted_here else i + 1

        if preempted:
            self.admission.record_preemption()
        lookahead = self.config.kv_admission == "lookahead" and bool(self.waiting) and not preempted
        if lookahead:  # the running requests' tokens now and the output they are still expected to add
            planned = self.admission.running_entries(self.running, self.kv_cache.pool.blocks)
            capacity = self.kv_cache.pool.num_usable_blocks
        while self.waiting and budget > 0 and not preempted:
            request = self.waiting[0]
            if self.running and len(self.running) + request.num_samples_to_fork > self.config.max_num_seqs:
                break
            hits = self.kv_cache.get_computed_blocks(request)
            if lookahead:
                num_shared = sum(1 for block in hits if block.ref_cnt > 0) * self.kv_cache.block_size
                candidate = self.admission.entries(request, num_shared)
                # in order: the requests behind it wait too, so a large one is not passed over for ever; the
                # first request into an empty engine starts whatever the estimate, so every request can run
                if planned and self.admission.peak_blocks(planned + candidate) > capacity:
                    break
            num_hit_tokens = len(hits) * self.kv_cache.block_size
            num_new = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv_cache.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            if request.num_computed_tokens == 0:
                self.kv_cache.record_prefix_lookup(request.num_tokens, num_hit_tokens)
                request.num_cached_tokens = (
                    num_hit_tokens if request.num_preemptions == 0 else request.num_cached_tokens
                )
            request.num_computed_tokens += num_hit_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new, self._num_samples(request, num_new)))
            budget -= num_new
            if lookahead:
                planned += candidate

        scheduled.sort(key=lambda s: not s.is_decode)  # decodes first (stable)
        num_tokens = self.config.max_num_batched_tokens - budget
        output = SchedulerOutput(scheduled, self.kv_cache.take_pending_copies(), num_tokens)
        if scheduled:  # an empty output never reaches the runner: the keys wait for the next step that does
            output.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        return output

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance progress, cache full blocks, append sampled tokens, finish and free requests."""
        outputs: list[EngineCoreOutput] = []
        self.num_steps += 1
        self._iteration_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, sched.num_batched_tokens)] += 1
        self._iteration_tokens_sum += sched.num_batched_tokens
        for item, tokens, logprobs, prompt_logprobs in zip(
            sched.scheduled, result.sampled_token_ids, result.logprobs, result.prompt_logprobs
        ):
            request = item.request
            if request.is_finished:
                continue
            if item.spec_token_ids:
                outputs.append(self._update_speculative(item, tokens, logprobs))
                continue
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.num_prompt_tokens += min(
                    item.num_new_tokens, request.num_prompt_tokens - request.num_computed_tokens
                )
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_blocks(request)
            if prompt_logprobs and not request.prompt_logprobs_sent:
                request.prompt_logprobs.extend(prompt_logprobs)
            if not tokens:
                continue
            samples = [request]
            if len(tokens) > 1:
                samples += self._fork(request, len(tokens))
            for k, (sample, token_id) in enumerate(zip(samples, tokens)):
                sample.append_token(token_id)
                self.num_generation_tokens += 1
                finish_reason, stop_reason = self._check_stop(sample, token_id)
                new_logprobs = [logprobs[k]] if logprobs else None
                outputs.append(self._make_output(sample, [token_id], new_logprobs, finish_reason, stop_reason))
        if outputs:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _update_speculative(self, item: ScheduledRequest, tokens: list[int], logprobs: list | None) -> EngineCoreOutput:
        """A decode with drafts: ``tokens`` are the accepted drafts and the model's next token. They are
        appended up to the first that finishes the request; the K/V of the last input token and of the
        accepted drafts is now computed."""
        request = item.request
        self._record_acceptance(request, len(item.spec_token_ids), len(tokens) - 1)
        finish_reason = stop_reason = None
        num_appended = 0
        for token_id in tokens:
            request.append_token(token_id)
            num_appended += 1
            finish_reason, stop_reason = self._check_stop(request, token_id)
            if finish_reason is not None:
                break
        self.num_generation_tokens += num_appended
        request.num_computed_tokens += num_appended
        self.kv_cache.cache_blocks(request)
        new_logprobs = logprobs[:num_appended] if logprobs else None
        return self._make_output(request, tokens[:num_appended], new_logprobs, finish_reason, stop_reason)

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request, within the budget, ``max_tokens`` and the context."""
        params = request.sampling_params
        if request.num_samples_to_fork > 1:
            return []
        if request.spec_skip_steps:
            request.spec_skip_steps -= 1
            return []
        max_drafts = min(budget, self.max_model_len - request.num_tokens) - 1  # each step emits drafts + 1
        if params.max_tokens is not None:
            max_drafts = min(max_drafts, params.max_tokens - request.num_output_tokens - 1)
        if max_drafts <= 0:
            return []
        if self.proposer is None:  # a draft model: slots that the runner fills (not under a grammar's mask)
            if params.structured_outputs is not None:
                return []
            return [DRAFT_PENDING] * min(self.speculative.num_speculative_tokens, max_drafts)
        return self.proposer.propose(request.all_token_ids, max_drafts)

    def _record_acceptance(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.spec_accepted_per_pos[position] += 1
        if num_accepted == 0:  # back off: this request's continuation does not follow its context now
            request.spec_backoff = min(max(1, 2 * request.spec_backoff), MAX_SPEC_BACKOFF_STEPS)
            request.spec_skip_steps = request.spec_backoff
        else:
            request.spec_backoff = 0

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_blocks=self.kv_cache.pool.num_usable_blocks,
            kv_capacity_tokens=self.kv_cache.pool.num_usable_blocks * self.kv_cache.block_size,
            num_free_blocks=self.kv_cache.num_free_blocks,
            num_cached_free_blocks=self.kv_cache.pool.num_cached_free_blocks,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps,
            iteration_token_counts=tuple(self._iteration_token_counts),
            iteration_tokens_sum=self._iteration_tokens_sum,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
        )

    def reset_counters(self) -> None:
        """Zero the cumulative counters (after warm-up, so metrics count only real traffic)."""
        self.num_preemptions = self.num_prompt_tokens = self.num_generation_tokens = self.num_steps = 0
        self._iteration_token_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._iteration_tokens_sum = 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        num_positions = self.speculative.num_speculative_tokens if self.speculative is not None else 0
        self.spec_accepted_per_pos = [0] * num_positions
        self.kv_cache.prefix_cache_queries = self.kv_cache.prefix_cache_hits = 0

    # ----------------------------------------------------------------- helpers
    def _num_samples(self, request: Request, num_new: int) -> int:
        if request.num_computed_tokens + num_new < request.num_tokens:
            return 0
        return request.num_samples_to_fork

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    @staticmethod
    def _unschedule(scheduled: list[ScheduledRequest], victim: Request) -> int:
        for k, item in enumerate(scheduled):
            if item.request is victim:
                del scheduled[k]
                return item.num_new_tokens
        return 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs = []
        self.waiting.appendleft(request)

    def _fork(self, parent: Request, n: int) -> list[Request]:
        children = []
        for index in range(1, n):
            child = parent.fork(index)
            self.kv_cache.share_blocks(parent, child)
            children.append(child)
        parent.num_samples_to_fork = 1
        self.running.extend(children)
        self.requests[parent.request_id].extend(children)
        return children

    def _make_output(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: list | None,
        finish_reason: FinishReason | None,
        stop_reason: int | None,
    ) -> EngineCoreOutput:
        """The output of this step's new tokens (already appended); finishes the request if they did."""
        output = EngineCoreOutput(
            request_id=request.request_id,
            index=request.index,
            new_token_ids=token_ids,
            new_logprobs=logprobs if logprobs and logprobs[0] is not None else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_cached_tokens=request.num_cached_tokens,
        )
        if not request.first_output_sent:
            request.first_output_sent = True
            output.first_scheduled_time = request.first_scheduled_time
            if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                request.prompt_logprobs_sent = True
                output.prompt_logprobs = request.prompt_logprobs
        if finish_reason is not None:
            self.admission.record_finished(request)
            self._finish(request, finish_reason, stop_reason)
        return output

    def _check_stop(self, request: Request, token_id: int) -> tuple[FinishReason | None, int | None]:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.STOP, None
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return FinishReason.LENGTH, None
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None) -> None:
        if request.is_finished:
            return
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_cache.free(request)
        # an unforked sample 0 also stands for samples 1..n-1, whose generators the runner may have made
        self.finished_req_ids.update(
            (request.request_id, request.index + i) for i in range(request.num_samples_to_fork)
        )
        samples = self.requests.get(request.request_id)
        if samples is not None:
            samples.remove(request)
            if not samples:
                del self.requests[request.request_id]
