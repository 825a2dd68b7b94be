"""/metrics without a model: engine state per served model and replica, the KV cache shape per model,
a core client's own families (merged by name), and per-request series labelled by their model."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from pagedserve.engine.output_processor import IterationStats
from pagedserve.messages import ModelInfo, ReplicaStatus, SchedulerStats
from pagedserve.metrics import Metrics
from tests.utils import parse_metrics


class FakeCore:
    def __init__(self, name: str, replicas: int, routed: bool = False) -> None:
        self.model_info = ModelInfo(name, 128, 100, (), "float32", num_kv_blocks=10, block_size=16)
        self._replicas = replicas
        if routed:
            self.metric_families = lambda: [self._routed()]

    def replica_statuses(self) -> list[ReplicaStatus]:
        return [
            ReplicaStatus(str(i), 1000 + i, "node", SchedulerStats(num_running=i + 1)) for i in range(self._replicas)
        ]

    def _routed(self) -> CounterMetricFamily:
        family = CounterMetricFamily("pagedserve:router_requests", "Requests routed.", labels=["model_name"])
        family.add_metric([self.model_info.model_name], 7)
        return family


def test_engine_state_per_model_and_replica():
    cores = [("a", FakeCore("a", 1)), ("b", FakeCore("b", 2, routed=True)), ("c", FakeCore("c", 1, routed=True))]
    metrics = Metrics("a", lambda: cores)
    text = metrics.render().decode()
    values = parse_metrics(text)
    assert values['pagedserve:num_requests_running{model_name="a",replica="0"}'] == 1
    assert values['pagedserve:num_requests_running{model_name="b",replica="1"}'] == 2
    assert values['pagedserve:cache_config_info{block_size="16",model_name="b",num_gpu_blocks="10"}'] == 1
    assert values['pagedserve:router_requests_total{model_name="b"}'] == 7
    assert values['pagedserve:router_requests_total{model_name="c"}'] == 7
    for name in ("num_requests_running", "router_requests_total", "cache_config_info"):
        assert text.count(f"# TYPE pagedserve:{name} ") == 1  # one family per name, whatever the models


def test_request_series_per_model():
    metrics = Metrics("a", lambda: [])
    metrics.for_model("b").record(IterationStats(num_generation_tokens=3))
    assert metrics.for_model("b") is metrics.for_model("b")
    metrics.record_rejected("overloaded", "b")
    metrics.record_rejected("rate_limited")
    values = parse_metrics(metrics.render().decode())
    assert values['pagedserve:generation_tokens_total{model_name="b"}'] == 3
    assert 'pagedserve:generation_tokens_total{model_name="a"}' not in values
    assert values['pagedserve:request_rejected_total{model_name="b",reason="overloaded"}'] == 1
    assert values['pagedserve:request_rejected_total{model_name="a",reason="rate_limited"}'] == 1
