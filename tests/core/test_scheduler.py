"""Scheduler unit tests (the cases of TGI's queue tests, plus chunking, preemption, abort, priority, forks).

The model runner is replaced by a function that "samples" a fixed token, so only scheduling is under test.
"""

from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.messages import ITERATION_TOKEN_BUCKETS
from pagedserve.outputs import FinishReason
from pagedserve.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, policy="fcfs", max_model_len=1000, chunked=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS)
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy, enable_chunked_prefill=chunked
    )
    return Scheduler(config, kv, max_model_len)


def make_request(request_id: str, num_prompt: int, arrival: float = 0.0, priority: int = 0, **params) -> Request:
    params.setdefault("max_tokens", 4)
    sp = SamplingParams(**params)
    prompt = [10 + (hash(request_id) + i) % 50 for i in range(num_prompt)]
    return Request(request_id, 0, prompt, sp, arrival, (EOS,), priority=priority, num_samples_to_fork=sp.n)


def run_step(scheduler: Scheduler, token: int = 7):
    sched = scheduler.schedule()
    result = ModelRunnerOutput(
        sampled_token_ids=[[token + k for k in range(item.num_samples)] for item in sched.scheduled],
        logprobs=[None] * len(sched.scheduled),
        prompt_logprobs=[None] * len(sched.scheduled),
    )
    return sched, scheduler.update_from_output(sched, result)


def scheduled_ids(sched: SchedulerOutput) -> dict[str, int]:
    return {item.request.request_id: item.num_new_tokens for item in sched.scheduled}


def assert_no_leak(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.pool.num_usable_blocks


def test_empty_queue_schedules_nothing():
    scheduler = make_scheduler()
    sched = scheduler.schedule()
    assert sched.is_empty and sched.num_batched_tokens == 0


def test_sequence_cap():
    scheduler = make_scheduler(max_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 5))
    sched, _ = run_step(scheduler)
    assert set(scheduled_ids(sched)) == {"a", "b"}
    assert len(scheduler.waiting) == 1


def test_token_budget_and_chunked_prefill():
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10))
    sched, outputs = run_step(scheduler)
    assert scheduled_ids(sched) == {"a": 10, "b": 6}  # b is chunked to the rest of the budget
    assert [o.request_id for o in outputs] == ["a"]  # only a finished its prompt and sampled
    sched, outputs = run_step(scheduler)
    assert scheduled_ids(sched) == {"a": 1, "b": 4}  # decode first, then the rest of b's prompt
    assert sched.scheduled[0].request.request_id == "a"
    assert {o.request_id for o in outputs} == {"a", "b"}


def test_stats_count_steps_by_their_tokens():
    """vLLM's iteration_tokens_total: per bucket (upper bounds, then one past them all), and the sum."""
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10))
    sizes = []
    while scheduler.has_unfinished_requests():
        sched, _ = run_step(scheduler)
        sizes.append(sched.num_batched_tokens)
    assert sizes[:2] == [16, 5]
    stats = scheduler.get_stats()
    assert len(stats.iteration_token_counts) == len(ITERATION_TOKEN_BUCKETS) + 1
    expected = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    for size in sizes:  # the first bound at or above the step's tokens
        expected[next(i for i, bound in enumerate(ITERATION_TOKEN_BUCKETS) if size <= bound)] += 1
    assert list(stats.iteration_token_counts) == expected and expected[4] >= 1  # 16 -> le=16, 5 -> le=8
    assert stats.iteration_tokens_sum == sum(sizes) and sum(expected) == stats.num_steps == len(sizes)
    assert stats.kv_capacity_tokens == stats.num_blocks * BS  # published to the request routers
    scheduler.reset_counters()
    stats = scheduler.get_stats()
    assert stats.iteration_tokens_sum == 0 and not any(stats.iteration_token_counts)


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=16, chunked=False)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10))
    sched, _ = run_step(scheduler)
    assert scheduled_ids(sched) == {"a": 10}


def test_long_prompt_is_prefilled_over_several_steps():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 20, max_tokens=1))
    sizes = []
    while scheduler.has_unfinished_requests():
        sched, _ = run_step(scheduler)
        sizes.append(sched.num_batched_tokens)
    assert sizes == [8, 8, 4]
    assert_no_leak(scheduler)


def test_finish_on_max_tokens_eos_and_stop_token_ids():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("len", 3, max_tokens=2))
    scheduler.add_request(make_request("eos", 3, max_tokens=10))
    scheduler.add_request(make_request("stop", 3, max_tokens=10, stop_token_ids=[7]))
    finished = {}
    for token in (5, 5, EOS, EOS):
        _, outputs = run_step(scheduler, token)
        for out in outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = (out.finish_reason, out.stop_reason)
        if not scheduler.has_unfinished_requests():
            break
    assert finished["len"] == (FinishReason.LENGTH, None)
    assert finished["eos"] == (FinishReason.STOP, None)
    assert_no_leak(scheduler)


def test_stop_token_id_and_min_tokens_and_ignore_eos():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("stop", 3, max_tokens=10, stop_token_ids=[7]))
    scheduler.add_request(make_request("min", 3, max_tokens=10, stop_token_ids=[7], min_tokens=3))
    scheduler.add_request(make_request("ign", 3, max_tokens=3, ignore_eos=True))
    lengths: dict[str, int] = {}
    reasons = {}
    while scheduler.has_unfinished_requests():
        _, outputs = run_step(scheduler, 7 if len(reasons) < 2 else EOS)
        for out in outputs:
            lengths[out.request_id] = lengths.get(out.request_id, 0) + 1
            if out.finish_reason:
                reasons[out.request_id] = (out.finish_reason, out.stop_reason)
    assert reasons["stop"] == (FinishReason.STOP, 7) and lengths["stop"] == 1
    assert reasons["min"] == (FinishReason.STOP, 7) and lengths["min"] == 3
    assert reasons["ign"] == (FinishReason.LENGTH, None) and lengths["ign"] == 3


def test_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=6)
    scheduler.add_request(make_request("a", 4, max_tokens=None))
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += run_step(scheduler)[1]
    assert len(outputs) == 2 and outputs[-1].finish_reason == FinishReason.LENGTH


def test_preemption_frees_the_newest_and_it_resumes_first():
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens grow until the cache is full
    scheduler = make_scheduler(num_blocks=7, budget=64)
    scheduler.add_request(make_request("old", 8, arrival=0.0, max_tokens=12))
    scheduler.add_request(make_request("new", 8, arrival=1.0, max_tokens=12))
    tokens = {"old": 0, "new": 0}
    preempted_seen = False
    while scheduler.has_unfinished_requests():
        before = scheduler.num_preemptions
        sched, outputs = run_step(scheduler)
        if scheduler.num_preemptions > before:
            preempted_seen = True
            assert [r.request_id for r in scheduler.waiting][:1] == ["new"]  # back at the front
            assert "new" not in scheduled_ids(sched)
        for out in outputs:
            tokens[out.request_id] += len(out.new_token_ids)
    assert preempted_seen
    assert tokens == {"old": 12, "new": 12}  # nothing lost, nothing duplicated
    assert_no_leak(scheduler)


def test_priority_policy_admits_and_preempts_by_priority():
    scheduler = make_scheduler(max_seqs=1, policy="priority")
    scheduler.add_request(make_request("low", 3, arrival=0.0, priority=5))
    scheduler.add_request(make_request("high", 3, arrival=1.0, priority=0))
    sched, _ = run_step(scheduler)
    assert list(scheduled_ids(sched)) == ["high"]


def test_abort_while_waiting_and_while_running():
    scheduler = make_scheduler(max_seqs=1)
    scheduler.add_request(make_request("run", 5, max_tokens=50))
    scheduler.add_request(make_request("wait", 5))
    run_step(scheduler)
    assert scheduler.running[0].request_id == "run" and scheduler.waiting[0].request_id == "wait"
    scheduler.abort_requests(["wait"])
    assert not scheduler.waiting
    scheduler.abort_requests(["run"])
    assert not scheduler.running
    scheduler.abort_requests(["unknown"])  # no-op
    assert_no_leak(scheduler)
    sched = scheduler.schedule()
    assert sched.is_empty


def test_n_samples_fork_after_prefill_and_share_the_prompt():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6, n=3, max_tokens=3, temperature=1.0))
    sched, outputs = run_step(scheduler)
    assert sched.scheduled[0].num_samples == 3
    assert sorted(o.index for o in outputs) == [0, 1, 2]
    samples = scheduler.requests["a"]
    assert len(samples) == 3 and len(scheduler.running) == 3
    first_block = samples[0].block_ids[0]
    assert all(s.block_ids[0] == first_block for s in samples)
    assert scheduler.kv_cache.pool.blocks[first_block].ref_cnt == 3
    sched, _ = run_step(scheduler)
    assert len(sched.block_copies) == 2  # two of three copy the shared half-full block, the last writes in place
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert_no_leak(scheduler)


def test_stop_one_sample_keeps_the_others():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, n=2, max_tokens=5))
    run_step(scheduler)
    scheduler.stop_samples([("a", 1)])
    assert [s.index for s in scheduler.requests["a"]] == [0]
    counts = 0
    while scheduler.has_unfinished_requests():
        counts += len(run_step(scheduler)[1])
    assert counts == 4
    assert_no_leak(scheduler)


def test_prefix_cache_hit_skips_computed_tokens():
    scheduler = make_scheduler()
    first = make_request("a", 13, max_tokens=1)
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    second = make_request("b", 1, max_tokens=1)
    second.prompt_token_ids = list(first.prompt_token_ids)
    second.all_token_ids = list(first.prompt_token_ids)
    scheduler.add_request(second)
    sched, _ = run_step(scheduler)
    assert scheduled_ids(sched) == {"b": 1}  # 12 of 13 tokens came from the cache
    assert second.num_cached_tokens == 12
    assert scheduler.kv_cache.prefix_cache_hits == 12
    assert_no_leak(scheduler)
