"""Speculative decoding in the scheduler: prompt-lookup drafts in the token budget, acceptance, back-off.

The model runner is replaced by a "model" that continues a fixed cycle of tokens, so that drafts
looked up in a repeating prompt are right until the test decides otherwise.
"""

from __future__ import annotations

import pytest

from pagedserve.config import SchedulerConfig, SpeculativeConfig
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.ngram_proposer import NgramProposer
from pagedserve.core.request import Request
from pagedserve.core.sched_output import DRAFT_PENDING, ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.outputs import FinishReason
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

BS = 4
EOS = 2
CYCLE = [11, 12, 13, 14, 15, 16, 17]


def make_scheduler(
    num_blocks=64, budget=64, k=3, disable_by_batch_size=8, max_model_len=1000, lookup_min=2
) -> Scheduler:
    spec = SpeculativeConfig(
        num_speculative_tokens=k,
        prompt_lookup_max=3,
        prompt_lookup_min=lookup_min,
        disable_by_batch_size=disable_by_batch_size,
    )
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16)
    return Scheduler(config, KVCacheManager(num_blocks, BS), max_model_len, spec)


def cyclic_request(request_id: str, num_prompt: int = 16, **params) -> Request:
    params.setdefault("max_tokens", 20)
    sp = SamplingParams(**params)
    prompt = [CYCLE[i % len(CYCLE)] for i in range(num_prompt)]
    return Request(request_id, 0, prompt, sp, 0.0, (EOS,), num_samples_to_fork=sp.n)


def next_in_cycle(token: int) -> int:
    return CYCLE[(CYCLE.index(token) + 1) % len(CYCLE)] if token in CYCLE else CYCLE[0]


def model_tokens(item, wrong_from: int | None = None) -> list[int]:
    """What a runner returns for one scheduled request whose model continues the cycle: for drafts,
    the accepted ones and the next token; ``wrong_from``: the model disagrees from that draft on."""
    request = item.request
    last = request.all_token_ids[-1]
    if not item.spec_token_ids:
        return [next_in_cycle(last)] * item.num_samples
    out = []
    for j, draft in enumerate(item.spec_token_ids):
        want = next_in_cycle(last) if wrong_from is None or j < wrong_from else 99
        out.append(want)
        if draft != want:
            return out
        last = draft
    return out + [next_in_cycle(last)]


def run_step(scheduler: Scheduler, wrong_from: int | None = None, logprobs: bool = False):
    sched = scheduler.schedule()
    tokens = [model_tokens(item, wrong_from) for item in sched.scheduled]
    result = ModelRunnerOutput(
        sampled_token_ids=tokens,
        logprobs=[[f"lp{t}" for t in ts] if logprobs else None for ts in tokens],
        prompt_logprobs=[None] * len(sched.scheduled),
    )
    return sched, scheduler.update_from_output(sched, result)


def prefill(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)
    while any(request.num_output_tokens == 0 for request in requests):
        sched, _ = run_step(scheduler)
        prefilling = [item for item in sched.scheduled if item.request.num_output_tokens <= 1]
        assert not any(item.spec_token_ids for item in prefilling)  # no drafts in a prefill


def assert_no_leak(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.pool.num_usable_blocks


def test_proposer_finds_the_most_recent_longest_match():
    proposer = NgramProposer(min_n=1, max_n=3, num_speculative_tokens=3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3], 5) == [8, 7, 2]  # "2 3" last seen before "8 7"
    assert proposer.propose([5, 1, 2, 3, 4, 6, 2, 3, 4], 5) == [6, 2, 3]  # the 3-gram wins over shorter ones
    assert proposer.propose([1, 2, 3, 4], 5) == []  # nothing repeats
    assert proposer.propose([7, 7], 5) == [7]  # a match may end right before the suffix
    assert proposer.propose([1, 2, 1, 2], 1) == [1]  # capped by max_drafts
    assert proposer.propose([1, 2, 1, 2], 0) == []


def test_proposer_matches_whole_token_ids_only():
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: byte-level overlaps that are not token matches
    proposer = NgramProposer(min_n=2, max_n=2, num_speculative_tokens=2)
    assert proposer.propose([256, 1, 0, 0, 256, 1], 4) == [0, 0]
    assert proposer.propose([1, 256, 5, 0, 1, 0, 0, 1, 256], 4) == [5, 0]
    assert proposer.propose([65536, 1, 256, 1], 4) == []


def test_drafts_are_scheduled_in_the_budget_and_accepted_tokens_advance_the_request():
    scheduler = make_scheduler(k=3)
    request = cyclic_request("a")
    prefill(scheduler, request)
    num_before = request.num_tokens
    sched, outputs = run_step(scheduler, logprobs=True)
    (item,) = sched.scheduled
    assert item.spec_token_ids == [next_in_cycle(request.all_token_ids[num_before - 1])] + item.spec_token_ids[1:]
    assert len(item.spec_token_ids) == 3 and item.num_new_tokens == 4 and sched.num_batched_tokens == 4
    (output,) = outputs
    assert len(output.new_token_ids) == 4 and output.new_logprobs == [f"lp{t}" for t in output.new_token_ids]
    assert request.num_tokens == num_before + 4
    assert request.num_computed_tokens == request.num_tokens - 1  # the model's own token is not computed yet
    stats = scheduler.get_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 3, 3)
    assert stats.spec_accepted_per_pos == (1, 1, 1)
    assert stats.num_generation_tokens == 5  # 1 from the prefill, 4 from the verified step


def test_a_rejected_draft_is_rolled_back_and_its_slots_reused():
    scheduler = make_scheduler(k=3)
    request = cyclic_request("a")
    prefill(scheduler, request)
    num_before = request.num_tokens
    sched, (output,) = run_step(scheduler, wrong_from=1)  # first draft right, second wrong
    assert output.new_token_ids == [sched.scheduled[0].spec_token_ids[0], 99]
    assert request.num_tokens == num_before + 2 and request.num_computed_tokens == num_before + 1
    assert scheduler.get_stats().spec_accepted_per_pos == (1, 0, 0)
    # blocks held never exceed what the request's tokens and one step of drafts need
    assert len(request.block_ids) <= cdiv(request.num_tokens + 3, BS)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, wrong_from=1)
        assert len(request.block_ids) <= cdiv(request.num_tokens + 3, BS)
    assert_no_leak(scheduler)


def test_whole_rejection_backs_off_and_acceptance_resumes_drafting():
    scheduler = make_scheduler(k=2, lookup_min=1)  # a 1-gram finds a match again right after a wrong token
    request = cyclic_request("a", max_tokens=200)
    prefill(scheduler, request)
    sched, _ = run_step(scheduler, wrong_from=0)
    assert sched.scheduled[0].spec_token_ids and request.spec_skip_steps == 1
    sched, _ = run_step(scheduler)
    assert not sched.scheduled[0].spec_token_ids  # one step without drafts
    sched, _ = run_step(scheduler, wrong_from=0)
    assert sched.scheduled[0].spec_token_ids and request.spec_skip_steps == 2  # the pause doubles
    for _ in range(2):
        sched, _ = run_step(scheduler)
        assert not sched.scheduled[0].spec_token_ids
    sched, _ = run_step(scheduler)
    assert sched.scheduled[0].spec_token_ids and request.spec_backoff == 0  # accepted: back to drafting


def test_max_tokens_is_never_exceeded_and_a_stop_token_among_drafts_ends_the_output():
    scheduler = make_scheduler(k=4)
    request = cyclic_request("a", max_tokens=6)
    prefill(scheduler, request)
    sched, (output,) = run_step(scheduler)
    assert len(sched.scheduled[0].spec_token_ids) == 4  # 1 + 4 tokens: the 5 that are left
    assert request.num_output_tokens == 6 and request.finish_reason is FinishReason.LENGTH
    assert_no_leak(scheduler)

    scheduler = make_scheduler(k=4)
    request = cyclic_request("c", max_tokens=3)
    prefill(scheduler, request)
    sched, _ = run_step(scheduler)
    assert len(sched.scheduled[0].spec_token_ids) == 1 and request.num_output_tokens == 3
    assert_no_leak(scheduler)

    scheduler = make_scheduler(k=4)
    request = cyclic_request("b", max_tokens=50, stop_token_ids=[14])
    prefill(scheduler, request)
    while scheduler.has_unfinished_requests():
        _, outputs = run_step(scheduler)
    assert request.output_token_ids[-1] == 14 and 14 not in request.output_token_ids[:-1]
    assert request.finish_reason is FinishReason.STOP and request.stop_reason == 14
    assert_no_leak(scheduler)


def test_drafts_respect_the_token_budget_and_the_context_length():
    scheduler = make_scheduler(k=4, budget=20)
    requests = [cyclic_request(name, num_prompt=10) for name in "abcd"]
    prefill(scheduler, *requests)
    sched, _ = run_step(scheduler)
    assert sched.num_batched_tokens <= 20
    assert [len(item.spec_token_ids) for item in sched.scheduled] == [4, 4, 4, 4]
    scheduler = make_scheduler(k=4, budget=10)
    prefill(scheduler, *[cyclic_request(name, num_prompt=10) for name in "abcd"])
    sched, _ = run_step(scheduler)
    assert sched.num_batched_tokens <= 10 and len(sched.scheduled) >= 2

    scheduler = make_scheduler(k=4, max_model_len=19)
    request = cyclic_request("a", num_prompt=16, max_tokens=None)
    prefill(scheduler, request)  # 17 tokens: at most 1 draft keeps the output within 19 tokens
    sched, _ = run_step(scheduler)
    assert len(sched.scheduled[0].spec_token_ids) == 1
    assert request.num_tokens == 19 and request.finish_reason is FinishReason.LENGTH


def test_no_room_for_drafts_runs_the_plain_decode_without_preempting():
    scheduler = make_scheduler(num_blocks=6, k=4)  # 5 usable blocks of 4 tokens
    a = cyclic_request("a", num_prompt=14, max_tokens=100)  # 15 tokens after its prefill: 4 blocks
    b = cyclic_request("b", num_prompt=3, max_tokens=2)  # 1 block
    prefill(scheduler, a, b)
    assert scheduler.kv_cache.num_free_blocks == 0
    sched, _ = run_step(scheduler)  # a's drafts would need a 6th block; its plain decode fits
    assert [(item.request.request_id, item.num_new_tokens) for item in sched.scheduled] == [("a", 1), ("b", 1)]
    assert scheduler.num_preemptions == 0
    assert_invariants(scheduler)


def assert_invariants(scheduler: Scheduler) -> None:
    for request in scheduler.running:
        assert len(request.block_ids) * BS >= request.num_computed_tokens
        assert request.num_computed_tokens == request.num_tokens - 1


def test_large_batches_and_unforked_n_run_without_drafts():
    scheduler = make_scheduler(k=3, disable_by_batch_size=2)
    requests = [cyclic_request(name) for name in "abc"]
    prefill(scheduler, *requests)
    sched, _ = run_step(scheduler)
    assert not any(item.spec_token_ids for item in sched.scheduled)  # 3 running > 2
    scheduler.abort_requests(["c"])
    sched, _ = run_step(scheduler)
    assert all(item.spec_token_ids for item in sched.scheduled)

    scheduler = make_scheduler(k=3)
    grammar = StructuredOutputsParams(regex="[a-z]+")
    constrained = cyclic_request("g", structured_outputs=grammar)
    forked = cyclic_request("n", n=2, temperature=1.0)
    prefill(scheduler, constrained, forked)
    sched, _ = run_step(scheduler)
    drafted = {item.request.key: bool(item.spec_token_ids) for item in sched.scheduled}
    # forks draft each on their own; a grammar's drafts are masked by its matcher in the engine
    assert drafted == {("g", 0): True, ("n", 0): True, ("n", 1): True}


def test_preemption_of_a_drafting_request_loses_nothing():
    scheduler = make_scheduler(num_blocks=13, k=3, budget=64)  # 12 usable blocks; each request needs 8 at its end
    a, b = cyclic_request("a", num_prompt=12, max_tokens=20), cyclic_request("b", num_prompt=12, max_tokens=20)
    prefill(scheduler, a, b)
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        run_step(scheduler)
        assert_invariants(scheduler)
    assert scheduler.num_preemptions >= 1 and scheduler.get_stats().spec_num_accepted_tokens > 0
    for request in (a, b):
        assert request.num_output_tokens == 20 and request.finish_reason is FinishReason.LENGTH
        tokens = request.all_token_ids
        assert all(tokens[i + 1] == next_in_cycle(tokens[i]) for i in range(len(tokens) - 1))
    assert_no_leak(scheduler)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
        ({"method": "eagle"}, "must be one of"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "must not exceed"),
        ({"method": "ngram", "lookahead": 3}, "unknown key"),
        ({"num_speculative_tokens": 3}, "'method' is required"),
        ({"method": "draft_model"}, 'needs "model"'),
        ({"method": "draft_model", "model": ""}, 'needs "model"'),
        ({"method": "ngram", "model": "/some/dir"}, "is for method 'draft_model'"),
    ],
)
def test_speculative_config_errors(values, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(values)


def test_speculative_config_with_a_model_is_a_draft_model():
    config = SpeculativeConfig.from_dict({"model": "/some/dir", "num_speculative_tokens": 3})  # vLLM's reading
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/some/dir", 3)


def test_a_draft_model_leaves_slots_for_the_runner_to_fill():
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        KVCacheManager(64, 4),
        200,
        SpeculativeConfig("draft_model", num_speculative_tokens=3, model="/some/dir"),
    )
    request = cyclic_request("a")
    scheduler.add_request(request)
    sched = scheduler.schedule()  # the prompt: no drafts
    assert not sched.scheduled[0].spec_token_ids
    scheduler.update_from_output(sched, ModelRunnerOutput([[next_in_cycle(request.all_token_ids[-1])]], [None], [None]))
    item = scheduler.schedule().scheduled[0]
    assert item.spec_token_ids == [DRAFT_PENDING] * 3 and item.num_new_tokens == 4


def test_speculative_config_fills_the_other_lookup_bound():
    assert SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 6}).prompt_lookup_min == 2
    assert SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 1}).prompt_lookup_min == 1
    assert SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 6}).prompt_lookup_max == 6


def test_scheduler_output_rows():
    request = cyclic_request("a")
    from pagedserve.core.sched_output import ScheduledRequest

    assert ScheduledRequest(request, 4, 1, [1, 2, 3]).num_logit_rows == 4
    assert ScheduledRequest(request, 1, 3).num_logit_rows == 3
    assert SchedulerOutput().is_empty
