"""Load generation: targets, arrival processes, closed and open loops, and the side-by-side sweep.

A sweep runs every (workload, load point) against each target in turn, so that drift on a
noisy machine hits all targets alike. Each (workload, point) gets its own seed, shared by the
targets, so they see the same prompts and no two points share prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from pagedserve.bench.datasets import PromptFactory, RequestSource, SampleRequest
from pagedserve.bench.kv_demand import KVDemand, kv_demand_summary
from pagedserve.bench.metrics import (
    PointMetrics,
    cost_per_1k_output_tokens,
    fill_token_counts,
    summarize,
    tokens_streamed_after,
)
from pagedserve.bench.monitor import MemoryStats, ServerMonitor
from pagedserve.bench.request_funcs import ENDPOINT_PATHS, RequestFuncInput, RequestFuncOutput, async_request_openai


@dataclass(slots=True)
class Target:
    """A server under test: ``[name=]URL[,api_key=K][,model=M][,pid=P]`` on the command line."""

    name: str
    base_url: str
    api_key: str | None = None
    model: str | None = None
    pid: int | None = None

    def url(self, path: str) -> str:
        return self.base_url + path

    @classmethod
    def parse(cls, spec: str) -> Target:
        head, *options = spec.split(",")
        name, sep, url = head.partition("=")
        if not sep or "://" in name:
            name, url = "", head
        url = url.strip().rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if "://" not in url:
            url = "http://" + url
        target = cls(name=name.strip() or (urlsplit(url).netloc or url), base_url=url)
        for option in options:
            key, _, value = option.partition("=")
            key = key.strip().replace("-", "_")
            if key == "api_key":
                target.api_key = value
            elif key == "model":
                target.model = value
            elif key == "pid":
                target.pid = int(value)
            else:
                raise ValueError(f"unknown target option {key!r} in {spec!r} (use api_key, model or pid)")
        return target


@dataclass(slots=True)
class LoadPoint:
    """Closed loop (``concurrency`` clients, each sending its next request when the last finishes)
    or open loop (``request_rate`` arrivals per second, optionally capped at ``concurrency``)."""

    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0

    @property
    def is_open(self) -> bool:
        return self.request_rate is not None

    @property
    def label(self) -> str:
        if self.is_open:
            rate = "inf" if math.isinf(self.request_rate or 0) else f"{self.request_rate:g}"
            cap = f",c={self.concurrency}" if self.concurrency else ""
            burst = f",b={self.burstiness:g}" if self.burstiness != 1.0 else ""
            return f"rate={rate}{burst}{cap}"
        return f"c={self.concurrency}"


@dataclass(slots=True)
class BenchOptions:
    """Everything about how requests are sent and the run is measured (shared by all targets)."""

    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int | None = 32
    duration: float | None = None
    num_warmups: int = 1
    ignore_eos: bool = False
    temperature: float = 0.0
    include_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    slos: dict[str, float] = field(default_factory=dict)
    price_per_hour: float | None = None
    memory_interval: float = 1.0
    server_pid: int | None = None
    request_timeout: float = 3600.0
    drain_timeout: float = math.inf  # after --duration: how long in-flight requests may finish
    warmup_output_len: int | None = 16  # cap on warm-up outputs (they only warm the server up)
    # with duration: seconds the load runs before the measured window opens (a steady-state window)
    warmup_duration: float = 0.0
    # closed loop: clients start one by one, evenly over this many seconds (inside the warm-up), so
    # their requests' phases are spread as in a long-running service instead of all starting at once
    ramp_up: float = 0.0
    progress: bool = True


@dataclass(slots=True)
class PointRecord:
    """The summary of one (target, workload, load point) run: its identity, then its figures.

    ``to_json()`` is its object in summary.json's ``results``: these fields in this order, with those
    of ``metrics``, ``memory`` and ``kv_demand`` spliced in flat where they stand.
    """

    target: str
    url: str
    model: str
    workload: str
    point: str  # the load point's label
    concurrency: int | None
    request_rate: float | str | None  # "inf" for an infinite rate (JSON has no infinity)
    burstiness: float | None  # open loop only
    seed: int
    num_requests: int
    metrics: PointMetrics
    memory: MemoryStats
    price_per_hour: float | None
    cost_per_1k_output_tokens: float | None
    kv_demand: KVDemand

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {}
        for name in (f.name for f in fields(self)):
            value = getattr(self, name)
            if isinstance(value, PointMetrics):
                record.update(value.to_json())
            elif isinstance(value, (MemoryStats, KVDemand)):
                record.update(asdict(value))
            else:
                record[name] = value
        return record


@dataclass(slots=True)
class PointResult:
    """One (target, workload, load point) run: raw outputs and the summary record."""

    target: Target
    workload: str
    point: LoadPoint
    seed: int
    outputs: list[RequestFuncOutput]
    warmup_outputs: list[RequestFuncOutput]
    record: PointRecord


def arrival_intervals(request_rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Gaps between arrivals: gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson.

    Burstiness below 1 is burstier than Poisson, above 1 more regular; infinite rate sends all at once.
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(request_rate):
        while True:
            yield 0.0
    theta = 1.0 / (request_rate * burstiness)
    while True:
        yield float(rng.gamma(shape=burstiness, scale=theta))


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets (s) from the start of the first ``num`` arrivals; the first request goes at once."""
    intervals = arrival_intervals(request_rate, burstiness, np.random.default_rng(seed))
    times, now = [], 0.0
    for index in range(num):
        if index:
            now += next(intervals)
        times.append(now)
    return times


class _Feed:
    """Hands out requests: pre-generated ones first (no tokenizing while measuring), then fresh ones."""

    def __init__(self, source: RequestSource, num_prompts: int | None, duration: float | None) -> None:
        self.source = source
        self.limit = num_prompts
        self.deadline: float | None = None
        self.duration = duration
        self.pending = source.take(num_prompts if num_prompts else 64)
        self.issued = 0  # requests sent since the window opened (those before it are warm-up)
        self.opens = 0.0

    def start(self, opens: float) -> None:
        """The measured window opens at ``opens`` (perf_counter; later than now after a warm-up)."""
        self.opens = opens
        self.deadline = opens + self.duration if self.duration else None

    def next(self) -> tuple[SampleRequest, bool] | None:
        """The next request and whether it is measured (sent once the window is open), or None when done."""
        if self.limit is not None and self.issued >= self.limit:
            return None
        now = time.perf_counter()
        if self.deadline is not None and now >= self.deadline:
            return None
        measured = now >= self.opens
        if measured:
            self.issued += 1
        return (self.pending.pop(0) if self.pending else self.source.next()), measured


Send = Callable[[SampleRequest, float | None, bool], Awaitable[RequestFuncOutput]]


async def _closed_loop(feed: _Feed, concurrency: int, send: Send, ramp_up: float = 0.0) -> None:
    """``concurrency`` clients, client i starting ``i * ramp_up / concurrency`` seconds after the first."""

    async def client(index: int) -> None:
        if ramp_up > 0 and index:
            await asyncio.sleep(index * ramp_up / concurrency)
        while (issued := feed.next()) is not None:
            sample, measured = issued
            await send(sample, None, measured)

    await asyncio.gather(*(client(index) for index in range(concurrency)))


async def _open_loop(feed: _Feed, point: LoadPoint, seed: int, send: Send) -> None:
    semaphore = asyncio.Semaphore(point.concurrency) if point.concurrency else None
    intervals = arrival_intervals(point.request_rate or math.inf, point.burstiness, np.random.default_rng(seed))

    async def one(sample: SampleRequest, scheduled: float, measured: bool) -> None:
        if semaphore is None:
            await send(sample, scheduled, measured)
            return
        async with semaphore:
            await send(sample, scheduled, measured)

    tasks: list[asyncio.Task[None]] = []
    scheduled = time.perf_counter()
    try:
        while (issued := feed.next()) is not None:
            sample, measured = issued
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sample, scheduled, measured)))
            scheduled += next(intervals)
            if feed.deadline is not None and scheduled >= feed.deadline:
                break
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def resolve_model(client: httpx.AsyncClient, target: Target, options: BenchOptions) -> str:
    """The model name to send: the target's, the run's, or the first one the server lists."""
    if target.model or options.model:
        return target.model or options.model or ""
    headers = (
        {"Authorization": f"Bearer {target.api_key or options.api_key}"} if (target.api_key or options.api_key) else {}
    )
    try:
        response = await client.get(target.url("/v1/models"), headers=headers, timeout=10.0)
        data = response.json().get("data") or []
        if response.status_code == 200 and data:
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return ""


async def server_version(client: httpx.AsyncClient, target: Target) -> str | None:
    try:
        response = await client.get(target.url("/version"), timeout=5.0)
        if response.status_code == 200:
            return str(response.json().get("version"))
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None


async def run_point(
    client: httpx.AsyncClient,
    target: Target,
    model: str,
    workload: str,
    source: RequestSource,
    point: LoadPoint,
    seed: int,
    options: BenchOptions,
    tokenizer: Any | None = None,
) -> PointResult:
    """Warm up, then measure one load point against one target."""
    make_input = functools.partial(_request_input, target=target, model=model, options=options)
    warmup_outputs = await _warm_up(client, source, point, options, make_input)
    window = await _measure(
        client, target, source, point, seed, options, make_input, f"{target.name} {workload} {point.label}"
    )
    outputs, before_window = window.sender.measured, window.sender.unmeasured
    _rebase_times(outputs + before_window + warmup_outputs, window.opens)
    fill_token_counts(outputs + before_window, tokenizer)
    carried = sum(tokens_streamed_after(output, 0.0) for output in before_window)  # streamed inside the window
    warmup_outputs.extend(before_window)
    record = _point_record(target, model, workload, point, seed, options, window, warmup_outputs, carried)
    return PointResult(target, workload, point, seed, outputs, warmup_outputs, record)


def _request_input(
    sample: SampleRequest, warmup: bool, *, target: Target, model: str, options: BenchOptions
) -> RequestFuncInput:
    """The request that sends ``sample`` to ``target``; a warm-up's output is capped at ``warmup_output_len``."""
    output_len = sample.output_len
    if warmup and options.warmup_output_len:
        output_len = min(output_len, options.warmup_output_len)
    return RequestFuncInput(
        prompt=sample.prompt,
        prompt_len=sample.prompt_len,
        output_len=output_len,
        model=model,
        api_url=target.url(ENDPOINT_PATHS[options.endpoint]),
        endpoint=options.endpoint,
        api_key=target.api_key if target.api_key is not None else options.api_key,
        ignore_eos=options.ignore_eos,
        temperature=options.temperature,
        include_usage=options.include_usage,
        extra_body=options.extra_body,
        workload=sample.workload,
    )


@dataclass(slots=True)
class _Sender:
    """A ``Send``: streams each request into a new output and keeps it, the measured ones apart."""

    client: httpx.AsyncClient
    make_input: Callable[[SampleRequest, bool], RequestFuncInput]
    warmup: bool = False  # --num-warmups requests: capped outputs, none measured
    progress: Any = None
    measured: list[RequestFuncOutput] = field(default_factory=list)
    unmeasured: list[RequestFuncOutput] = field(default_factory=list)  # warm-ups, or sent before the window opened

    async def __call__(self, sample: SampleRequest, scheduled: float | None, measured: bool) -> RequestFuncOutput:
        measured = measured and not self.warmup
        output = RequestFuncOutput()
        (self.measured if measured else self.unmeasured).append(
            output
        )  # NOTE: first, so a cut-off request still counts
        await async_request_openai(self.client, self.make_input(sample, self.warmup), scheduled, output)
        if self.progress is not None and measured:
            self.progress.update(1)
        return output


async def _warm_up(
    client: httpx.AsyncClient,
    source: RequestSource,
    point: LoadPoint,
    options: BenchOptions,
    make_input: Callable[[SampleRequest, bool], RequestFuncInput],
) -> list[RequestFuncOutput]:
    """The ``num_warmups`` requests sent before the load point (closed loop, outputs capped); their outputs."""
    sender = _Sender(client, make_input, warmup=True)
    if options.num_warmups > 0:
        feed = _Feed(source, options.num_warmups, None)
        await _closed_loop(feed, min(options.num_warmups, point.concurrency or 1), sender)
    return sender.unmeasured


@dataclass(slots=True)
class _Window:
    """The measured phase: its requests (``sender``), the server's samples, when it opened (perf_counter), its length."""

    sender: _Sender
    monitor: ServerMonitor
    opens: float
    duration: float


async def _measure(
    client: httpx.AsyncClient,
    target: Target,
    source: RequestSource,
    point: LoadPoint,
    seed: int,
    options: BenchOptions,
    make_input: Callable[[SampleRequest, bool], RequestFuncInput],
    description: str,
) -> _Window:
    """Run the load at ``point`` while sampling the server, until it is done or the window is over."""
    feed = _Feed(source, options.num_prompts, options.duration)
    sender = _Sender(client, make_input, progress=_progress_bar(options, description))
    monitor = ServerMonitor(client, target.url("/metrics"), target.pid or options.server_pid, options.memory_interval)
    warmup_s = options.warmup_duration if options.duration else 0.0
    opens = time.perf_counter() + warmup_s  # when the measured window opens
    if not warmup_s:
        await monitor.sample()
    monitor.start(delay=warmup_s)
    feed.start(opens)
    await _run_or_cut_off(_load(feed, point, seed, sender, options), _time_limit(options, warmup_s))
    duration = time.perf_counter() - opens
    await monitor.stop()
    if sender.progress is not None:
        sender.progress.close()
    return _Window(sender, monitor, opens, duration)


def _load(feed: _Feed, point: LoadPoint, seed: int, send: Send, options: BenchOptions) -> Coroutine[Any, Any, None]:
    """The load: arrivals at the point's rate (open loop), else its number of clients (closed loop)."""
    if point.is_open:
        return _open_loop(feed, point, seed, send)
    return _closed_loop(feed, point.concurrency or 1, send, options.ramp_up)


def _time_limit(options: BenchOptions, warmup_s: float) -> float | None:
    """How long the load may run (warm-up, window and drain time); None: until every request is done."""
    if options.duration and not math.isinf(options.drain_timeout):
        return warmup_s + options.duration + options.drain_timeout
    return None


async def _run_or_cut_off(load: Coroutine[Any, Any, None], timeout: float | None) -> None:
    """Run ``load`` to its end, or cancel it after ``timeout`` seconds (the requests still running are cut off)."""
    task = asyncio.create_task(load)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if done:
        task.result()
    else:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _rebase_times(outputs: list[RequestFuncOutput], opens: float) -> None:
    """Send and schedule times from perf_counter to seconds since the window opened (negative before it)."""
    for output in outputs:
        output.start_time -= opens
        if output.scheduled_time is not None:
            output.scheduled_time -= opens


def _point_record(
    target: Target,
    model: str,
    workload: str,
    point: LoadPoint,
    seed: int,
    options: BenchOptions,
    window: _Window,
    warmup_outputs: list[RequestFuncOutput],
    carried_output_tokens: int,
) -> PointRecord:
    """The point's summary: the measured requests' metrics, the server's memory, the cost and the KV needed."""
    outputs, monitor = window.sender.measured, window.monitor
    sampled = monitor.kv_times or monitor.sample_times  # the KV samples' instants, else the memory samples'
    kv_demand = kv_demand_summary(
        outputs + warmup_outputs, [t - window.opens for t in sampled], monitor.kv, window.duration, monitor.cache_config
    )
    metrics = summarize(outputs, window.duration, options.slos, carried_output_tokens)
    # NOTE: the tokens the window produced, as in output_throughput (cut-off requests included)
    delivered = metrics.total_output_tokens + metrics.incomplete_output_tokens + metrics.warmup_carried_output_tokens
    return PointRecord(
        target=target.name,
        url=target.base_url,
        model=model,
        workload=workload,
        point=point.label,
        concurrency=point.concurrency,
        request_rate=point.request_rate if point.request_rate is None or not math.isinf(point.request_rate) else "inf",
        burstiness=point.burstiness if point.is_open else None,
        seed=seed,
        num_requests=len(outputs),
        metrics=metrics,
        memory=monitor.summary(),
        price_per_hour=options.price_per_hour,
        cost_per_1k_output_tokens=cost_per_1k_output_tokens(options.price_per_hour, metrics.duration_s, delivered),
        kv_demand=kv_demand,
    )


def _progress_bar(options: BenchOptions, description: str) -> Any:
    if not options.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=options.num_prompts, desc=description, unit="req", leave=False, dynamic_ncols=True)


async def run_sweep(
    targets: list[Target],
    workloads: list[str],
    points: list[LoadPoint],
    options: BenchOptions,
    factory: PromptFactory,
    base_seed: int,
    source_kwargs: dict[str, Any] | None = None,
    on_result: Callable[[PointResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[PointResult], dict[str, dict[str, Any]]]:
    """Every workload x point, each against every target in turn. Returns results and per-target info."""
    max_clients = max((p.concurrency or 0) for p in points) if points else 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(16, max_clients + 8))
    timeout = httpx.Timeout(options.request_timeout, connect=30.0)
    results: list[PointResult] = []
    info: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, transport=transport) as client:
        models = {}
        for target in targets:
            models[target.name] = await resolve_model(client, target, options)
            info[target.name] = {
                "url": target.base_url,
                "model": models[target.name],
                "server_version": await server_version(client, target),
            }
        index = 0
        for workload in workloads:
            for point in points:
                seed = base_seed + 1000 * index
                index += 1
                for target in targets:
                    source = RequestSource(workload, factory, seed, **(source_kwargs or {}))
                    result = await run_point(
                        client, target, models[target.name], workload, source, point, seed, options, factory.tokenizer
                    )
                    results.append(result)
                    if on_result is not None:
                        on_result(result)
    return results, info
