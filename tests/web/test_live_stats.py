"""Unit tests for the dashboard's JSON: histogram quantiles as Prometheus computes them, one-minute rates
and percentiles from the same counters /metrics serves, the block pools, ``since``, and counters that
restart when an engine is swapped."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine.output_processor import FinishedRequestStats, IterationStats
from pagedserve.entrypoints.web.live_stats import LiveStats, bucket_delta, quantile
from pagedserve.messages import ReplicaStatus, SchedulerStats
from pagedserve.outputs import FinishReason

INF = float("inf")


class EngineStub:
    """Stands in for an engine core: only the stats snapshots the sampler reads."""

    def __init__(self, *stats: SchedulerStats) -> None:
        self.stats = list(stats)

    def replica_statuses(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(str(i), 0, "host", s) for i, s in enumerate(self.stats)]


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = ((0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0))
    assert quantile(0.25, buckets) == pytest.approx(0.1 * 10 / 10)  # rank 10: top of the first bucket
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert quantile(0.99, ((0.1, 1.0), (INF, 5.0))) == 0.1  # in +Inf: the highest finite bound
    assert quantile(0.5, ((0.1, 0.0), (INF, 0.0))) is None
    assert quantile(0.5, ()) is None


def test_bucket_delta_never_goes_negative():
    assert bucket_delta(((1.0, 5.0), (INF, 7.0)), ((1.0, 2.0), (INF, 9.0))) == ((1.0, 3.0), (INF, 0.0))


def _observe(metrics, model: str, *, prompt: int, generated: int, ttfts=(), itls=(), finished=()) -> None:
    stats = IterationStats()
    stats.num_prompt_tokens = prompt
    stats.num_generation_tokens = generated
    stats.time_to_first_tokens.extend(ttfts)
    stats.inter_token_latencies.extend(itls)
    stats.finished_requests.extend(finished)
    metrics.for_model(model).record(stats)


def _finished(reason: FinishReason) -> FinishedRequestStats:
    return FinishedRequestStats(
        finish_reason=reason, e2e_latency=1.0, num_prompt_tokens=4, num_generation_tokens=8, max_tokens=8, n=1,
        queue_time=0.0, prefill_time=0.1, decode_time=0.9, inference_time=1.0, time_per_output_token=0.1,
    )  # fmt: skip


@pytest.fixture
def setup():
    from pagedserve.metrics import Metrics

    engines = {"a": EngineStub(SchedulerStats()), "b": EngineStub(SchedulerStats(), SchedulerStats())}
    metrics = Metrics("a", lambda: list(engines.items()))
    live = LiveStats(metrics, lambda: list(engines.items()), window_s=60.0)
    return metrics, engines, live


def test_report_rates_percentiles_pools_and_reasons(setup):
    metrics, engines, live = setup
    live.take_sample(now=100.0)
    _observe(metrics, "a", prompt=300, generated=100, ttfts=[0.05] * 9 + [3.0], itls=[0.02] * 10)
    _observe(metrics, "b", prompt=100, generated=100, finished=[_finished(FinishReason.LENGTH)] * 2)
    engines["a"].stats[0] = SchedulerStats(
        num_running=3, num_waiting=2, num_blocks=100, num_free_blocks=60, num_cached_free_blocks=25,
        prefix_cache_queries=1000, prefix_cache_hits=250, num_preemptions=1, num_steps=40, iteration_tokens_sum=480,
    )  # fmt: skip
    engines["b"].stats[1] = SchedulerStats(num_running=1, num_blocks=50, num_free_blocks=50, num_steps=10)
    live.take_sample(now=110.0)
    report = json.loads(json.dumps(live.report()))  # what the page gets
    assert (report["running"], report["waiting"], report["preemptions"]) == (4, 2, 1)
    window = report["window"]
    assert window["prompt_tokens_per_s"] == pytest.approx(40.0)
    assert window["generation_tokens_per_s"] == pytest.approx(20.0)
    assert window["tokens_per_step"] == pytest.approx(480 / 50)
    assert window["steps_per_s"] == pytest.approx(5.0)
    assert window["num_first_tokens"] == 10
    assert 0.04 <= window["ttft_s"]["0.5"] <= 0.06  # inside the bucket of the nine 50 ms ones
    assert window["ttft_s"]["0.99"] > 2.5  # the slow one
    assert 0.01 <= window["itl_s"]["0.5"] <= 0.025
    assert report["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert report["finished"] == {"abort": 0, "length": 2, "stop": 0}
    pools = {(p["model"], p["replica"]): p for p in report["block_pools"]}
    assert pools[("a", "0")] == {
        "model": "a", "replica": "0", "num_blocks": 100, "used": 40, "cached_free": 25, "free": 35
    }  # fmt: skip
    assert pools[("b", "1")]["free"] == 50
    assert ("b", "0") not in pools  # a replica without a paged cache (num_blocks 0) has no picture
    assert [p["t"] for p in report["points"]] == [110.0]
    assert report["points"][0]["kv_usage"] == pytest.approx(40 / 150)


def test_since_returns_only_new_points_and_the_window_slides(setup):
    metrics, _, live = setup
    for t in range(0, 200, 10):
        _observe(metrics, "a", prompt=0, generated=10 if t < 100 else 0)
        live.take_sample(now=float(t))
    report = live.report()
    assert report["now"] == 190.0
    assert len(report["points"]) == 19
    assert [p["t"] for p in live.report(since=170.0)["points"]] == [180.0, 190.0]
    assert live.report(since=190.0)["points"] == []
    # the last minute had no generated tokens, although the counter's total is 100
    assert report["window"]["generation_tokens_per_s"] == 0.0
    assert report["points"][0]["generation_tokens_per_s"] == pytest.approx(1.0)


def test_engine_counters_that_restart_after_a_swap_give_no_negative_rates(setup):
    _, engines, live = setup
    engines["a"].stats[0] = SchedulerStats(num_steps=500, iteration_tokens_sum=5000, num_preemptions=9)
    live.take_sample(now=0.0)
    engines["a"].stats[0] = SchedulerStats(num_steps=3, iteration_tokens_sum=30)  # a new engine
    live.take_sample(now=1.0)
    window = live.report()["window"]
    assert window["steps_per_s"] == 0.0 and window["tokens_per_step"] == 0.0 and window["preemptions"] == 0


def test_history_is_bounded():
    from pagedserve.metrics import Metrics

    metrics = Metrics("a", lambda: [])
    live = LiveStats(metrics, lambda: [], interval_s=1.0, history_s=10.0)
    for t in range(100):
        live.take_sample(now=float(t))
    assert len(live.report()["points"]) == 10
