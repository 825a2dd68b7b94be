"""SchedulerOutput.finished_req_ids: the samples finished since the last non-empty output, for the
runner to drop their state (seeded generators). A preempted sample is not finished."""

from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched_output import ModelRunnerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks: int = 64, max_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs)
    return Scheduler(config, KVCacheManager(num_blocks, BS), max_model_len=1000)


def make_request(request_id: str, num_prompt: int = 5, **params) -> Request:
    params.setdefault("max_tokens", 3)
    params.setdefault("ignore_eos", True)
    sp = SamplingParams(**params)
    return Request(request_id, 0, list(range(10, 10 + num_prompt)), sp, 0.0, (2,), num_samples_to_fork=sp.n)


def step(scheduler: Scheduler):
    sched = scheduler.schedule()
    result = ModelRunnerOutput(
        [[7] * item.num_samples for item in sched.scheduled],
        [None] * len(sched.scheduled),
        [None] * len(sched.scheduled),
    )
    scheduler.update_from_output(sched, result)
    return sched


def test_finished_samples_reach_the_next_step_once():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=1, n=2))
    scheduler.add_request(make_request("b", max_tokens=4))
    assert step(scheduler).finished_req_ids == set()  # both prefill; a's samples 0 and 1 finish at once
    assert step(scheduler).finished_req_ids == {("a", 0), ("a", 1)}
    assert step(scheduler).finished_req_ids == set()
    step(scheduler)  # b finishes
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("c"))
    assert step(scheduler).finished_req_ids == {("b", 0)}


def test_empty_steps_keep_the_keys_for_the_next_step_that_runs():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    step(scheduler)
    scheduler.abort_requests(["a"])
    for _ in range(2):
        sched = scheduler.schedule()
        assert sched.is_empty and sched.finished_req_ids == set()  # never reaches the runner
    scheduler.add_request(make_request("a"))  # the id again: the old sample's key comes first
    sched = step(scheduler)
    assert sched.finished_req_ids == {("a", 0)} and [item.request.key for item in sched.scheduled] == [("a", 0)]


def test_aborting_before_the_fork_covers_every_sample():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("w", n=3))  # never scheduled
    scheduler.abort_requests(["w"])
    scheduler.add_request(make_request("x"))
    assert step(scheduler).finished_req_ids == {("w", 0), ("w", 1), ("w", 2)}


def test_stopped_fork_is_reported_alone():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", n=3, max_tokens=5))
    step(scheduler)  # prefill and fork
    scheduler.stop_samples([("a", 1)])
    assert step(scheduler).finished_req_ids == {("a", 1)}


def test_preempted_samples_are_not_finished():
    # 6 usable blocks of 4 tokens: two growing requests preempt each other
    scheduler = make_scheduler(num_blocks=7)
    scheduler.add_request(make_request("old", 8, max_tokens=12))
    scheduler.add_request(make_request("new", 8, max_tokens=12))
    reported: list[tuple[str, int]] = []
    while scheduler.has_unfinished_requests():
        reported += step(scheduler).finished_req_ids
    scheduler.add_request(make_request("last"))
    reported += step(scheduler).finished_req_ids
    assert scheduler.num_preemptions > 0
    assert sorted(reported) == [("new", 0), ("old", 0)]  # each once, at its end
