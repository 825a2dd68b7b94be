"""Server-side resource sampling during a benchmark: resident memory, KV-cache usage and the prefix
cache's hit rate.

Memory comes from ``psutil`` (the server's pid plus all its children) when a pid is given,
else from the ``process_resident_memory_bytes`` gauge of the server's Prometheus ``/metrics``.
KV usage comes from ``pagedserve:kv_cache_usage_perc`` (or vLLM's gauges) when exposed, and the
cache's shape (block size, block count) from ``cache_config_info``; the prefix-cache hit rate is the
growth of the hit counter over that of the query counter (tokens, summed over every replica's
series) between the first and the last sample. Efficiency is average / peak
over the measured phase, as vLLM / TGI serving comparisons report it. Each sample's time is kept,
so that the KV the requests needed at those instants can be rebuilt afterwards (``kv_demand``).
"""

from __future__ import annotations

import asyncio
import operator
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

RSS_METRICS = ("process_resident_memory_bytes",)
KV_METRICS = ("pagedserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
CACHE_CONFIG_METRICS = ("pagedserve:cache_config_info", "vllm:cache_config_info")
# (queries, hits) counters in tokens, pagedserve's and vLLM's names
PREFIX_CACHE_METRICS = (
    ("pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(
    text: str, names: tuple[str, ...], combine: Callable[[float, float], float] = max
) -> dict[str, float]:
    """Each wanted metric name's sample values (labels ignored) in Prometheus text format, combined across
    its series: the largest by default, ``operator.add`` for their sum."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.partition(" ")
        name = head.split("{", 1)[0]
        if name not in names:
            continue
        if "{" in head and "}" not in head:  # a label value held a space
            rest = line.split("}", 1)[1]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        values[name] = combine(values[name], value) if name in values else value
    return values


def prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """``(queries, hits)`` of the prefix cache in tokens, each summed over its labelled series, if exposed."""
    for queries_name, hits_name in PREFIX_CACHE_METRICS:
        totals = parse_prometheus(text, (queries_name, hits_name), combine=operator.add)
        if totals:
            return totals.get(queries_name, 0.0), totals.get(hits_name, 0.0)
    return None


def parse_cache_config(text: str) -> dict[str, int] | None:
    """``block_size`` and ``num_gpu_blocks`` from a ``cache_config_info`` line's labels, if exposed."""
    for line in text.splitlines():
        name, brace, labels = line.partition("{")
        if not brace or name not in CACHE_CONFIG_METRICS:
            continue
        found = dict(_LABEL.findall(labels))
        try:
            config = {"block_size": int(found["block_size"]), "num_gpu_blocks": int(found["num_gpu_blocks"])}
        except (KeyError, ValueError):
            continue
        if config["block_size"] > 0 and config["num_gpu_blocks"] > 0:
            return config
    return None


def process_tree_rss(pid: int) -> int | None:
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


@dataclass(slots=True)
class MemoryStats:
    """Server memory and KV usage over the measured phase; efficiency = average / peak (None: no samples)."""

    peak_rss_bytes: float | None
    avg_rss_bytes: float | None
    memory_efficiency: float | None
    rss_source: str | None
    peak_kv_usage: float | None  # fraction of the KV cache, 0..1
    avg_kv_usage: float | None
    kv_efficiency: float | None
    num_memory_samples: int
    prefix_cache_hit_rate: float | None = None  # hit / queried prompt tokens over the measured phase, 0..1


class ServerMonitor:
    """Samples memory and KV usage every ``interval`` seconds between ``start()`` and ``stop()``."""

    def __init__(
        self, client: httpx.AsyncClient, metrics_url: str | None, pid: int | None, interval: float = 1.0
    ) -> None:
        self.client = client
        self.metrics_url = metrics_url
        self.pid = pid
        self.interval = interval
        self.rss: list[float] = []
        self.kv: list[float] = []
        self.sample_times: list[float] = []  # perf_counter of every sample
        self.kv_times: list[float] = []  # perf_counter of the samples in ``kv``
        self.cache_config: dict[str, int] | None = None
        self.prefix_counters: list[tuple[float, float]] = []  # (queries, hits) at each sample that had them
        self.rss_source: str | None = None
        self._metrics_ok = metrics_url is not None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def sample(self) -> None:
        now = time.perf_counter()
        self.sample_times.append(now)
        rss = process_tree_rss(self.pid) if self.pid else None
        if rss is not None:
            self.rss.append(float(rss))
            self.rss_source = f"psutil pid {self.pid} + children"
        if not self._metrics_ok:
            return
        try:
            response = await self.client.get(self.metrics_url, timeout=5.0)  # type: ignore[arg-type]
        except httpx.HTTPError:
            return
        if response.status_code != 200:
            self._metrics_ok = False
            return
        values = parse_prometheus(response.text, RSS_METRICS + KV_METRICS)
        if rss is None and "process_resident_memory_bytes" in values:
            self.rss.append(values["process_resident_memory_bytes"])
            self.rss_source = "/metrics process_resident_memory_bytes"
        for name in KV_METRICS:
            if name in values:
                self.kv.append(values[name])
                self.kv_times.append(now)
                break
        if self.cache_config is None:
            self.cache_config = parse_cache_config(response.text)
        counters = prefix_cache_counters(response.text)
        if counters is not None:
            self.prefix_counters.append(counters)

    async def _run(self, delay: float) -> None:
        if delay > 0:
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
                return
            except TimeoutError:
                pass
        while not self._stopping.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(self._stopping.wait(), self.interval)
            except TimeoutError:
                pass

    def start(self, delay: float = 0.0) -> None:
        """Sample every ``interval`` seconds, the first after ``delay`` (the end of a steady-state warm-up)."""
        self._task = asyncio.create_task(self._run(delay))

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await self._task
        await self.sample()

    def summary(self) -> MemoryStats:
        peak_rss = max(self.rss) if self.rss else None
        avg_rss = sum(self.rss) / len(self.rss) if self.rss else None
        peak_kv = max(self.kv) if self.kv else None
        avg_kv = sum(self.kv) / len(self.kv) if self.kv else None
        return MemoryStats(
            peak_rss_bytes=peak_rss,
            avg_rss_bytes=avg_rss,
            memory_efficiency=avg_rss / peak_rss if peak_rss else None,
            rss_source=self.rss_source,
            peak_kv_usage=peak_kv,
            avg_kv_usage=avg_kv,
            kv_efficiency=avg_kv / peak_kv if peak_kv else None,
            num_memory_samples=len(self.rss),
            prefix_cache_hit_rate=self._prefix_hit_rate(),
        )

    def _prefix_hit_rate(self) -> float | None:
        if len(self.prefix_counters) < 2:
            return None
        (queries_0, hits_0), (queries_1, hits_1) = self.prefix_counters[0], self.prefix_counters[-1]
        queried = queries_1 - queries_0
        return (hits_1 - hits_0) / queried if queried > 0 else None
