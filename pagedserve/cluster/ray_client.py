"""RayEngineCoreClient: the front end's EngineCoreClient over engine replicas on Ray Serve.

Each request is one streaming call through the deployment handle (its router picks the replica); the
outputs of all streams are handed to AsyncLLM in batches, as from a local core. When a replica dies
(the stream raises), the request is sent again, through the router, to another replica: unstarted
requests are retried as they were, started ones are *resumed* from their prompt plus the tokens already
delivered, with the rest of their token budget, so the client sees one uninterrupted stream (text and
stop strings are the front end's, so nothing is emitted twice). Replica statuses are polled once a
second for the admin API and /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from pagedserve.cluster.routing_policy import PrefixAffinityIndex, prefix_chunk_hashes
from pagedserve.cluster.wire import ReplicaChunk
from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, ReplicaStatus, SchedulerStats

logger = logging.getLogger("pagedserve.cluster")

MAX_ATTEMPTS = 4  # one request: the first try and up to three retries / resumes
RETRY_BACKOFF_S = 0.2  # doubled per attempt: Serve needs a moment to drop a dead replica from its routers
STATUS_POLL_INTERVAL_S = 1.0


class _Stream:
    """One request on the cluster: what the client has been sent so far, per sample."""

    __slots__ = ("request", "tokens", "finished", "task", "replica_id", "attempt")

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request = request
        n = request.sampling_params.n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finished: set[int] = set()
        self.task: asyncio.Task | None = None
        self.replica_id: str | None = None
        self.attempt = 0

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.tokens)

    def attempt_request(self) -> EngineCoreRequest:
        """The request for the current attempt: as sent, or resumed after what was delivered."""
        request = self.request
        if self.attempt == 0:
            return request
        request_id = f"{request.request_id}~{self.attempt}"
        delivered = self.tokens[0] if len(self.tokens) == 1 else []
        if any(self.tokens) and len(self.tokens) > 1:
            raise EngineDeadError("a replica failed while streaming n > 1 samples; they cannot be resumed")
        if not delivered:
            return dataclasses.replace(request, request_id=request_id)
        params = request.sampling_params
        resumed = dataclasses.replace(
            params,
            max_tokens=None if params.max_tokens is None else params.max_tokens - len(delivered),
            min_tokens=max(0, params.min_tokens - len(delivered)),
            prompt_logprobs=None,  # sent with the first token already
        )
        return dataclasses.replace(
            request,
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids + delivered,
            sampling_params=resumed,
        )


class RouterCounters:
    """The front end's view of routing: requests per replica, retries, resumes, prefix affinity."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.retries = 0
        self.resumes = 0
        self.failed = 0
        self.prefix_queries = 0  # requests with at least one known prefix chunk
        self.prefix_hits = 0  # of them, sent to the replica that last served that prefix
        self._index = PrefixAffinityIndex()

    def record_first_chunk(self, request: EngineCoreRequest, replica_id: str, live: set[str]) -> None:
        self.requests[replica_id] = self.requests.get(replica_id, 0) + 1
        hashes = prefix_chunk_hashes(request.prompt_token_ids)
        if hashes:
            owner, matched = self._index.match(hashes, live | {replica_id})
            if owner is not None and matched:
                self.prefix_queries += 1
                self.prefix_hits += owner == replica_id
            self._index.record(hashes, replica_id)


class RayEngineCoreClient(EngineCoreClient):
    """EngineCoreClient over the replicas of one Ray Serve application (one served model)."""

    fails_single_requests = True  # a request that failed on every replica tried ends with an error

    def __init__(
        self,
        handle,  # ray.serve.handle.DeploymentHandle of the EngineReplica deployment
        model_info: ModelInfo,
        model_name: str,
        list_replica_actors: Callable[[], list],  # the replicas' Ray actor handles (blocking GCS call)
        on_shutdown: Callable[[], None],  # deletes the application (blocking)
    ) -> None:
        self._generate = handle.options(stream=True, method_name="generate")
        self._model_info = model_info
        self.model_name = model_name
        self._list_replica_actors = list_replica_actors
        self._on_shutdown = on_shutdown
        self._streams: dict[str, _Stream] = {}
        self._pending: list[EngineCoreOutput] = []
        self._wake: asyncio.Event | None = None
        self._statuses: dict[str, ReplicaStatus] = {}
        self._poller: asyncio.Task | None = None
        self._closed = False
        self.counters = RouterCounters()

    # ----------------------------------------------------------------- lifecycle
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def is_dead(self) -> bool:
        return False  # replicas come and go; Ray Serve replaces dead ones

    async def warmup(self) -> None:
        """The replicas warmed up in their constructors (Serve routes to none before that)."""
        await self._poll_statuses()

    async def start(self) -> None:
        self._wake = asyncio.Event()
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_loop(), name=f"replica-status-{self.model_name}")

    async def shutdown(self) -> None:
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
        for stream in list(self._streams.values()):
            if stream.task is not None:
                stream.task.cancel()
        await asyncio.to_thread(self._on_shutdown)

    # ----------------------------------------------------------------- requests
    async def add_request(self, request: EngineCoreRequest) -> None:
        if self._closed:
            raise EngineDeadError("the engine replicas are shutting down")
        stream = _Stream(request)
        self._streams[request.request_id] = stream
        stream.task = asyncio.create_task(self._run(stream), name=f"stream-{request.request_id}")

    async def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None and stream.task is not None:
                stream.task.cancel()  # cancels the streaming call: the replica aborts the request

    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        """A stop string finished a sample in the front end; once all of a request's have, end its stream."""
        for request_id, index in samples:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.finished.add(index)
                if stream.done:
                    await self.abort_requests([request_id])

    async def get_outputs(self) -> list[EngineCoreOutput]:
        assert self._wake is not None, "start() first"
        while not self._pending:
            await self._wake.wait()
            self._wake.clear()
        outputs, self._pending = self._pending, []
        return outputs

    # ----------------------------------------------------------------- one request's stream
    async def _run(self, stream: _Stream) -> None:
        request_id = stream.request.request_id
        try:
            while True:
                try:
                    await self._stream_attempt(stream)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a replica failed: retry or resume elsewhere
                    if stream.done or self._closed:
                        return
                    if stream.attempt + 1 >= MAX_ATTEMPTS or (len(stream.tokens) > 1 and any(stream.tokens)):
                        self._fail(stream, exc)
                        return
                    started = any(stream.tokens)
                    if started:
                        self.counters.resumes += 1
                    else:
                        self.counters.retries += 1
                    logger.warning(
                        "request %s: replica %s failed (%s); %s on another replica",
                        request_id,
                        stream.replica_id,
                        type(exc).__name__,
                        "resuming it" if started else "retrying it",
                    )
                    await asyncio.sleep(RETRY_BACKOFF_S * (2**stream.attempt))
                    stream.attempt += 1
        finally:
            self._streams.pop(request_id, None)

    async def _stream_attempt(self, stream: _Stream) -> None:
        request_id = stream.request.request_id
        attempt_request = stream.attempt_request()
        response = self._generate.remote(attempt_request)
        first = True
        try:
            async for chunk in response:
                chunk: ReplicaChunk
                if first:
                    first = False
                    stream.replica_id = chunk.replica_id
                    if stream.attempt == 0:
                        self.counters.record_first_chunk(stream.request, chunk.replica_id, set(self._statuses))
                self._deliver(stream, request_id, chunk.outputs)
                if stream.done:
                    return
        except asyncio.CancelledError:
            response.cancel()
            raise
        if not stream.done:
            raise EngineDeadError(f"the stream of request {request_id} ended before it finished")

    def _deliver(self, stream: _Stream, request_id: str, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            output.request_id = request_id
            if output.first_scheduled_time is not None:
                output.first_scheduled_time = min(output.first_scheduled_time, now)
            stream.tokens[output.index].extend(output.new_token_ids)
            if output.finish_reason is not None:
                stream.finished.add(output.index)
        self._pending.extend(outputs)
        if self._wake is not None:
            self._wake.set()

    def _fail(self, stream: _Stream, exc: BaseException) -> None:
        self.counters.failed += 1
        logger.error("request %s failed on every replica tried: %r", stream.request.request_id, exc)
        for index in range(len(stream.tokens)):
            if index not in stream.finished:
                stream.finished.add(index)
                self._pending.append(
                    EngineCoreOutput(stream.request.request_id, index, [], error=f"the engine replicas failed: {exc}")
                )
        if self._wake is not None:
            self._wake.set()

    # ----------------------------------------------------------------- replica statuses
    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(STATUS_POLL_INTERVAL_S)
            try:
                await self._poll_statuses()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a replica mid-restart; the next poll sees the new one
                logger.debug("replica status poll failed", exc_info=True)

    async def _poll_statuses(self) -> None:
        actors = await asyncio.to_thread(self._list_replica_actors)
        statuses: dict[str, ReplicaStatus] = {}
        results = await asyncio.gather(
            *(actor.record_routing_stats.remote() for actor in actors), return_exceptions=True
        )
        for result in results:
            if isinstance(result, dict) and isinstance(result.get("status"), ReplicaStatus):
                status = result["status"]
                statuses[status.replica_id] = status
        self._statuses = statuses

    def replica_statuses(self) -> list[ReplicaStatus]:
        return sorted(self._statuses.values(), key=lambda status: status.replica_id)

    def get_stats(self) -> SchedulerStats:
        return merge_stats([status.stats for status in self._statuses.values()])

    def metric_families(self) -> list:
        """Router counters for /metrics (requests per replica, retries, resumes, prefix affinity)."""
        from prometheus_client.core import CounterMetricFamily

        counters = self.counters
        requests = CounterMetricFamily(
            "pagedserve:router_requests", "Requests routed to each replica.", labels=["model_name", "replica"]
        )
        for replica_id, count in sorted(counters.requests.items()):
            requests.add_metric([self.model_name, replica_id], count)
        families = [requests]
        for name, doc, value in (
            ("router_retries", "Requests sent again after their replica failed before streaming.", counters.retries),
            ("router_resumes", "Requests resumed on another replica after theirs failed mid-stream.", counters.resumes),
            ("router_failed", "Requests that failed on every replica tried.", counters.failed),
            (
                "router_prefix_queries",
                "Requests whose prompt shares leading tokens with one routed before.",
                counters.prefix_queries,
            ),
            (
                "router_prefix_affinity_hits",
                "Of them, requests sent to the replica that last served that prefix.",
                counters.prefix_hits,
            ),
        ):
            family = CounterMetricFamily("pagedserve:" + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            families.append(family)
        return families


def merge_stats(snapshots: list[SchedulerStats]) -> SchedulerStats:
    """One snapshot for several replicas: counts and counters summed, KV usage over all their blocks."""
    if not snapshots:
        return SchedulerStats()
    merged = SchedulerStats()
    for field in dataclasses.fields(SchedulerStats):
        name = field.name
        if name in ("kv_cache_usage", "iteration_token_counts"):
            continue
        setattr(merged, name, sum(getattr(stats, name) for stats in snapshots))
    total_blocks = sum(stats.num_blocks for stats in snapshots)
    if total_blocks:
        merged.kv_cache_usage = sum(stats.kv_cache_usage * stats.num_blocks for stats in snapshots) / total_blocks
    else:
        merged.kv_cache_usage = sum(stats.kv_cache_usage for stats in snapshots) / len(snapshots)
    counts = [stats.iteration_token_counts for stats in snapshots if stats.iteration_token_counts]
    if counts:
        merged.iteration_token_counts = tuple(sum(column) for column in zip(*counts))
    return merged
