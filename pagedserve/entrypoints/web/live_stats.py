"""LiveStats: the live dashboard's numbers, sampled once a second from the series /metrics serves.

Each sample holds cumulative values summed over the served models (token counters, finish reasons,
the TTFT and inter-token-latency histograms' buckets) plus the engines' state at that moment (queues,
every replica's block pool). ``report`` turns the samples of the last few minutes into rates and
windowed percentiles, the way a Prometheus query would (``rate`` and ``histogram_quantile`` over one
minute), so the page never parses the Prometheus text and the numbers agree with /metrics.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.metrics import Metrics

QUANTILES = (0.5, 0.9, 0.99)
POINT_LATENCY_SPAN_S = 10.0  # a chart point's latency percentiles cover the seconds before it
Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), +Inf last


@dataclass(slots=True)
class BlockPoolState:
    """One replica's paged KV cache: in use by live requests, free but still prefix-cached, free."""

    model: str
    replica: str
    num_blocks: int
    used: int
    cached_free: int
    free: int


@dataclass(slots=True)
class Sample:
    """The cumulative counters and instantaneous state at ``time`` (monotonic seconds)."""

    time: float
    running: int = 0
    waiting: int = 0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    step_tokens: int = 0
    ttft: Buckets = ()
    itl: Buckets = ()
    finished: dict[str, float] = field(default_factory=dict)
    pools: list[BlockPoolState] = field(default_factory=list)


def counter_total(counter: Counter) -> float:
    """The sum of a counter's ``_total`` samples over all its label values."""
    return sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total"))


def counter_by_label(counter: Counter, label: str) -> dict[str, float]:
    """A counter's totals grouped by one label (summed over the others)."""
    totals: dict[str, float] = {}
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                key = s.labels[label]
                totals[key] = totals.get(key, 0.0) + s.value
    return totals


def histogram_buckets(histogram: Histogram) -> Buckets:
    """A histogram's cumulative bucket counts summed over all its label values, by upper bound."""
    counts: dict[float, float] = {}
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                bound = float(s.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + s.value
    return tuple(sorted(counts.items()))


def bucket_delta(new: Buckets, old: Buckets) -> Buckets:
    """Observations between two samples of the same histogram (bucket-wise difference, never negative)."""
    before = dict(old)
    return tuple((bound, max(count - before.get(bound, 0.0), 0.0)) for bound, count in new)


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket the rank falls in;
    the highest finite bound when it falls in +Inf; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


class LiveStats:
    """Samples ``metrics`` (and the engines behind ``sources``) every ``interval_s``; keeps
    ``history_s`` of samples for the charts and reports percentiles over the last ``window_s``."""

    def __init__(
        self,
        metrics: Metrics,
        sources: Callable[[], Iterable[tuple[str, EngineCoreClient]]],
        *,
        interval_s: float = 1.0,
        history_s: float = 300.0,
        window_s: float = 60.0,
    ) -> None:
        self._metrics = metrics
        self._sources = sources
        self.interval_s = interval_s
        self.window_s = window_s
        self._samples: deque[Sample] = deque(maxlen=max(2, int(history_s / interval_s) + 1))

    def take_sample(self, now: float | None = None) -> Sample:
        """Read every counter and engine once, and keep the sample."""
        metrics = self._metrics
        sample = Sample(
            time=time.monotonic() if now is None else now,
            prompt_tokens=counter_total(metrics.prompt_tokens),
            generation_tokens=counter_total(metrics.generation_tokens),
            ttft=histogram_buckets(metrics.ttft),
            itl=histogram_buckets(metrics.itl),
            finished=counter_by_label(metrics.request_success, "finished_reason"),
        )
        for model_name, core in self._sources():
            for status in core.replica_statuses():
                stats = status.stats
                sample.running += stats.num_running
                sample.waiting += stats.num_waiting
                sample.prefix_cache_queries += stats.prefix_cache_queries
                sample.prefix_cache_hits += stats.prefix_cache_hits
                sample.preemptions += stats.num_preemptions
                sample.steps += stats.num_steps
                sample.step_tokens += stats.iteration_tokens_sum
                if stats.num_blocks > 0:
                    free = stats.num_free_blocks
                    cached = min(stats.num_cached_free_blocks, free)
                    sample.pools.append(
                        BlockPoolState(
                            model_name,
                            status.replica_id,
                            stats.num_blocks,
                            stats.num_blocks - free,
                            cached,
                            free - cached,
                        )
                    )
        self._samples.append(sample)
        return sample

    async def run(self) -> None:
        """Sample forever (a background task of the server)."""
        while True:
            self.take_sample()
            await asyncio.sleep(self.interval_s)

    def report(self, since: float | None = None) -> dict:
        """The dashboard's JSON: the latest state, one-minute figures, and the chart points after
        ``since`` (seconds on the report's own clock, ``now`` of an earlier report; all when None)."""
        samples = list(self._samples)
        if not samples:
            samples = [self.take_sample()]
        latest = samples[-1]
        window_start = _sample_before(samples, latest.time - self.window_s)
        points = []
        start = 0  # the latest sample at or before the point's latency span starts
        for i in range(1, len(samples)):
            current = samples[i]
            while start + 1 < i and samples[start + 1].time <= current.time - POINT_LATENCY_SPAN_S:
                start += 1
            if since is None or current.time > since:
                points.append(_point(samples[i - 1], current, samples[start]))
        queries = latest.prefix_cache_queries - window_start.prefix_cache_queries
        hits = latest.prefix_cache_hits - window_start.prefix_cache_hits
        ttft = bucket_delta(latest.ttft, window_start.ttft)
        itl = bucket_delta(latest.itl, window_start.itl)
        return {
            "now": latest.time,
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "running": latest.running,
            "waiting": latest.waiting,
            "block_pools": [
                {
                    "model": pool.model,
                    "replica": pool.replica,
                    "num_blocks": pool.num_blocks,
                    "used": pool.used,
                    "cached_free": pool.cached_free,
                    "free": pool.free,
                }
                for pool in latest.pools
            ],
            "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
            "prefix_cache_hit_rate_total": (
                latest.prefix_cache_hits / latest.prefix_cache_queries if latest.prefix_cache_queries > 0 else None
            ),
            "preemptions": latest.preemptions,
            "finished": {reason: int(count) for reason, count in sorted(latest.finished.items())},
            "window": {
                **_rates(window_start, latest),
                "ttft_s": {str(q): quantile(q, ttft) for q in QUANTILES},
                "itl_s": {str(q): quantile(q, itl) for q in QUANTILES},
                "num_first_tokens": int(ttft[-1][1]) if ttft else 0,
            },
            "points": points,
        }


def _sample_before(samples: Sequence[Sample], t: float) -> Sample:
    """The latest sample at or before ``t`` (the oldest one if none is)."""
    chosen = samples[0]
    for sample in samples:
        if sample.time > t:
            break
        chosen = sample
    return chosen


def _rates(old: Sample, new: Sample) -> dict:
    """Tokens per second, tokens per step and preemptions between two samples (0 for an empty span)."""
    elapsed = new.time - old.time
    steps = new.steps - old.steps
    step_tokens = new.step_tokens - old.step_tokens
    return {
        "prompt_tokens_per_s": max(new.prompt_tokens - old.prompt_tokens, 0.0) / elapsed if elapsed > 0 else 0.0,
        "generation_tokens_per_s": (
            max(new.generation_tokens - old.generation_tokens, 0.0) / elapsed if elapsed > 0 else 0.0
        ),
        "tokens_per_step": step_tokens / steps if steps > 0 and step_tokens >= 0 else 0.0,
        "steps_per_s": max(steps, 0) / elapsed if elapsed > 0 else 0.0,
        "preemptions": max(new.preemptions - old.preemptions, 0),
    }


def _point(previous: Sample, new: Sample, span_start: Sample) -> dict:
    """One chart point: the state at ``new``, the rates since ``previous`` and the latency percentiles
    since ``span_start``."""
    usage = sum(pool.used for pool in new.pools) / max(sum(pool.num_blocks for pool in new.pools), 1)
    ttft = bucket_delta(new.ttft, span_start.ttft)
    itl = bucket_delta(new.itl, span_start.itl)
    return {
        "t": new.time,
        "running": new.running,
        "waiting": new.waiting,
        "kv_usage": usage,
        "ttft_p50_s": quantile(0.5, ttft),
        "ttft_p99_s": quantile(0.99, ttft),
        "itl_p50_s": quantile(0.5, itl),
        "itl_p99_s": quantile(0.99, itl),
        **_rates(previous, new),
    }
