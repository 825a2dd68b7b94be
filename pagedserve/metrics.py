"""Prometheus metrics with vLLM's names under the ``pagedserve:`` prefix, and the periodic stats log line.

Engine state (queues, KV usage, prefix cache, preemptions) is read at scrape time from the stats of
every served model's current core, per replica; per-request counters and histograms are fed by each
model's output handler, labelled with that model.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.engine.output_processor import IterationStats
from pagedserve.messages import ITERATION_TOKEN_BUCKETS, SchedulerStats

logger = logging.getLogger("pagedserve.stats")

PREFIX = "pagedserve:"
# fmt: off
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
# fmt: on
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


EngineSources = Callable[[], Iterable[tuple[str, EngineCoreClient]]]  # (served name, its current core) per model

_ENGINE_GAUGES = (
    ("num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
)
_ENGINE_COUNTERS = (
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
    ("num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
    (
        "engine_busy_seconds",
        "Wall seconds the engine core had requests in flight (step start to step start).",
        "busy_seconds",
    ),
    (
        "model_forward_seconds",
        "Wall seconds of engine_busy_seconds spent in the model forward pass and logits.",
        "model_forward_seconds",
    ),
    (
        "model_forward_cpu_seconds",
        "CPU seconds the engine core's process (all its threads) used during the model "
        "forward pass and logits; with --engine-core thread that process is the front end's too.",
        "model_forward_cpu_seconds",
    ),
    (
        "engine_core_cpu_seconds",
        "CPU seconds of the engine core's process (all its threads); with "
        "--engine-core thread that process is the front end's too.",
        "engine_cpu_seconds",
    ),
)


_SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
    ("spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_num_accepted_tokens"),
)


class _EngineStateCollector:
    """Gauges and counters read at scrape time from every served model's current core: one series per
    replica (``replica_statuses()``), labelled ``model_name`` and ``replica``; the KV cache's shape per
    model; and the families a core client adds itself (``metric_families()``, e.g. a router's counters)."""

    def __init__(self, sources: EngineSources) -> None:
        self._sources = sources

    def describe(self) -> list:
        return []  # NOTE: unchecked collector; the names are fixed and cannot clash

    def collect(self) -> Iterator:
        labels = ["model_name", "replica"]
        gauges = [(GaugeMetricFamily(PREFIX + name, doc, labels=labels), field) for name, doc, field in _ENGINE_GAUGES]
        counters = [
            (CounterMetricFamily(PREFIX + name, doc, labels=labels), field) for name, doc, field in _ENGINE_COUNTERS
        ]
        histogram = HistogramMetricFamily(
            PREFIX + "iteration_tokens_total", "Histogram of the number of tokens per engine step.", labels=labels
        )
        cache_info = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "Information of the KV cache config.",
            labels=["block_size", "num_gpu_blocks", "model_name"],
        )
        spec_counters = [
            (CounterMetricFamily(PREFIX + name, doc, labels=labels), field)
            for name, doc, field in _SPEC_DECODE_COUNTERS
        ]
        spec_per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*labels, "position"],
        )
        bounds = [str(float(bound)) for bound in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        extra: dict[str, Metric] = {}
        for model_name, core in self._sources():
            info = core.model_info
            if info.num_kv_blocks > 0:  # the paged cache's shape, as vLLM's cache_config_info (usage -> tokens)
                cache_info.add_metric([str(info.block_size), str(info.num_kv_blocks), model_name], 1)
            for status in core.replica_statuses():
                stats = status.stats
                value = [model_name, status.replica_id]
                for family, field in (*gauges, *counters):
                    family.add_metric(value, getattr(stats, field))
                if stats.spec_accepted_per_pos:  # speculative decoding is on
                    for family, field in spec_counters:
                        family.add_metric(value, getattr(stats, field))
                    for position, count in enumerate(stats.spec_accepted_per_pos):
                        spec_per_pos.add_metric([*value, str(position)], count)
                if stats.iteration_token_counts:  # the paged engine's steps
                    buckets = list(zip(bounds, itertools.accumulate(stats.iteration_token_counts)))
                    histogram.add_metric(value, buckets, stats.iteration_tokens_sum)
            metric_families = getattr(core, "metric_families", None)
            for family in metric_families() if metric_families is not None else ():
                if family.name in extra:  # one family per name, whichever models report it
                    extra[family.name].samples.extend(family.samples)
                else:
                    extra[family.name] = family
        yield from (family for family, _ in gauges)
        yield from (family for family, _ in counters)
        for family in (*(family for family, _ in spec_counters), spec_per_pos):
            if family.samples:
                yield family
        if histogram.samples:
            yield histogram
        if cache_info.samples:
            yield cache_info
        yield from extra.values()


class ModelRequestMetrics:
    """The per-request counters and histograms of one served model: ``record`` observes its AsyncLLM."""

    def __init__(self, metrics: Metrics, model_name: str) -> None:
        self.model_name = model_name
        self._success = metrics.request_success
        self.prompt_tokens = metrics.prompt_tokens.labels(model_name)
        self.generation_tokens = metrics.generation_tokens.labels(model_name)
        self.ttft = metrics.ttft.labels(model_name)
        self.itl = metrics.itl.labels(model_name)
        self.e2e = metrics.e2e.labels(model_name)
        self.queue_time = metrics.queue_time.labels(model_name)
        self.prefill_time = metrics.prefill_time.labels(model_name)
        self.decode_time = metrics.decode_time.labels(model_name)
        self.inference_time = metrics.inference_time.labels(model_name)
        self.time_per_output_token = metrics.time_per_output_token.labels(model_name)
        self.request_prompt_tokens = metrics.request_prompt_tokens.labels(model_name)
        self.request_generation_tokens = metrics.request_generation_tokens.labels(model_name)
        self.request_params_n = metrics.request_params_n.labels(model_name)
        self.request_params_max_tokens = metrics.request_params_max_tokens.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)

    def record(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies:
            self.itl.observe(value)
        for finished in stats.finished_requests:
            self._success.labels(self.model_name, finished.finish_reason.value).inc()
            self.e2e.observe(finished.e2e_latency)
            for histogram, value in (
                (self.queue_time, finished.queue_time),
                (self.prefill_time, finished.prefill_time),
                (self.decode_time, finished.decode_time),
                (self.inference_time, finished.inference_time),
            ):
                if value is not None:
                    histogram.observe(max(value, 0.0))
            if finished.time_per_output_token is not None:
                self.time_per_output_token.observe(finished.time_per_output_token)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            self.request_params_n.observe(finished.n)
            if finished.max_tokens is not None:
                self.request_params_max_tokens.observe(finished.max_tokens)


class Metrics:
    """All of one server's metrics in their own registry (no process-global state).

    ``sources`` lists the served models' current cores at scrape time; ``for_model(name)`` gives the
    per-request observer of one model (each model's AsyncLLM gets its own).
    """

    def __init__(self, default_model: str, sources: EngineSources) -> None:
        self.default_model = default_model
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        registry.register(_EngineStateCollector(sources))
        label = ["model_name"]
        self._models: dict[str, ModelRequestMetrics] = {}

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(PREFIX + name, doc, label + (extra or []), registry=registry)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "request_success", "Count of finished requests by finish reason.", ["finished_reason"]
        )
        self._rejected = counter(
            "request_rejected", "Requests refused before reaching the engine, by reason.", ["reason"]
        )
        self._slow_clients = counter(
            "slow_client_aborts",
            "Streams aborted because their client read nothing for --stream-stall-timeout seconds.",
            [],
        )
        self._structured = counter(
            "structured_output_requests",
            "Requests with an output constraint, by kind (json, regex, choice, grammar; tool calls: tools).",
            ["kind"],
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Histogram of time spent in the WAITING phase for request.", LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Histogram of time spent in the PREFILL phase for request.", LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "Histogram of time spent in the DECODE phase for request.", LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in the RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of the mean time per output token of each request, decode time / (generation tokens - 1).",
            ITL_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens per request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens per request.", TOKEN_BUCKETS
        )
        self.request_params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20, 50, 100]
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", TOKEN_BUCKETS
        )

    def for_model(self, model_name: str) -> ModelRequestMetrics:
        """The per-request metrics of ``model_name`` (the same object for every engine behind that name)."""
        metrics = self._models.get(model_name)
        if metrics is None:
            metrics = self._models[model_name] = ModelRequestMetrics(self, model_name)
        return metrics

    def record_rejected(self, reason: str, model_name: str | None = None) -> None:
        """A refused request (429), of ``model_name`` or, for the server-wide rate limit, the default model."""
        self._rejected.labels(model_name or self.default_model, reason).inc()

    def record_slow_client(self) -> None:
        """A stream aborted because its client stopped reading (counted under the default model)."""
        self._slow_clients.labels(self.default_model).inc()

    def record_structured(self, kind: str, model_name: str) -> None:
        """A request admitted with an output constraint of ``kind``."""
        self._structured.labels(model_name, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogLine:
    """Accumulates token counts and logs one line per interval while the server is busy (``label``, e.g.
    the model's name when several are served, starts the line)."""

    def __init__(self, get_stats: Callable[[], SchedulerStats], label: str = "") -> None:
        self._get_stats = get_stats
        self._prefix = f"[{label}] " if label else ""
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_time = time.monotonic()
        self._last_queries = 0
        self._last_hits = 0
        self._was_busy = False

    def record(self, stats: IterationStats) -> None:
        self._num_prompt_tokens += stats.num_prompt_tokens
        self._num_generation_tokens += stats.num_generation_tokens

    def maybe_log(self) -> str | None:
        """Log (and return) the line, unless the server was idle for the whole interval."""
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-6)
        stats = self._get_stats()
        busy = bool(self._num_prompt_tokens or self._num_generation_tokens or stats.num_running or stats.num_waiting)
        queries = stats.prefix_cache_queries - self._last_queries
        hits = stats.prefix_cache_hits - self._last_hits
        line = None
        if busy or self._was_busy:
            line = (
                f"{self._prefix}Avg prompt throughput: {self._num_prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._num_generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {hits / queries * 100 if queries > 0 else 0.0:.1f}%"
            )
            logger.info("%s", line)
        self._was_busy = busy
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._last_time = now
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        return line
