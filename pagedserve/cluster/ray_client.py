"""RayEngineCoreClient: the front end's EngineCoreClient over engine replicas on Ray Serve.

Each request is one ``add`` call through the deployment handle (its request router picks the replica);
each replica streams back the outputs of all this front end's requests on it, one batch per engine
step, over one ``outputs`` stream; AsyncLLM gets them in batches, as from a local core. When a replica
dies (its stream raises, or it leaves the cluster), its requests are sent again, through the router, to
the others: unstarted ones as they were, started ones *resumed* from their prompt plus the tokens
already delivered, with the rest of their token budget, so the client sees one uninterrupted stream
(text and stop strings are the front end's, so nothing is emitted twice). Replica statuses are polled
once a second for the admin API and /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

from pagedserve.cluster.routing_policy import PrefixAffinityIndex, prefix_chunk_hashes
from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, ReplicaStatus, SchedulerStats

logger = logging.getLogger("pagedserve.cluster")

MAX_ATTEMPTS = 4  # one request: the first try and up to three retries / resumes
RETRY_BACKOFF_S = 0.2  # doubled per attempt: Serve needs a moment to drop a dead replica from its routers
STATUS_POLL_INTERVAL_S = 1.0


class _Stream:
    """One request on the cluster: what the client has been sent so far, per sample."""

    __slots__ = ("request", "tokens", "finished", "replica_id", "attempt", "attempt_id", "ended")

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request = request
        n = request.sampling_params.n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finished: set[int] = set()
        self.replica_id: str | None = None  # where the current attempt runs, once placed
        self.attempt = 0
        self.attempt_id = request.request_id
        self.ended = False  # finished, aborted or failed: nothing more goes to the client

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

    def record_routed(self, request: EngineCoreRequest, replica_id: str, live: set[str]) -> None:
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
        list_replica_actors: Callable[[], dict],  # replica id -> its Ray actor handle (blocking GCS call)
        on_shutdown: Callable[[], None],  # deletes the application (blocking)
    ) -> None:
        self._add = handle.options(method_name="add")
        self._outputs = handle.options(method_name="outputs", stream=True)
        self._abort = handle.options(method_name="abort")
        self._stop = handle.options(method_name="stop")
        self._subscriber = uuid.uuid4().hex  # this front end, to the replicas
        self._model_info = model_info
        self.model_name = model_name
        self._list_replica_actors = list_replica_actors
        self._on_shutdown = on_shutdown
        self._streams: dict[str, _Stream] = {}  # request id -> stream
        self._by_attempt: dict[str, _Stream] = {}  # the request id an attempt was sent with -> stream
        self._on_replica: dict[str, set[str]] = {}  # replica id -> request ids placed there
        self._subscriptions: dict[str, asyncio.Task] = {}  # replica id -> the task reading its output stream
        self._tasks: set[asyncio.Task] = set()
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
        tasks = [*self._subscriptions.values(), *self._tasks, *([self._poller] if self._poller else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self._on_shutdown)

    # ----------------------------------------------------------------- requests
    async def add_request(self, request: EngineCoreRequest) -> None:
        if self._closed:
            raise EngineDeadError("the engine replicas are shutting down")
        stream = _Stream(request)
        self._streams[request.request_id] = stream
        self._spawn(self._place(stream))

    async def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._end(stream, abort_on_replica=True)

    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        """Stop strings matched in the front end: end the request once all its samples are done."""
        for request_id, index in samples:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            stream.finished.add(index)
            if stream.done:
                self._end(stream, abort_on_replica=True)
            elif stream.replica_id is not None:
                call = self._stop.remote([(stream.attempt_id, index)], target_replica=stream.replica_id)
                self._spawn(_with_timeout(call))

    async def get_outputs(self) -> list[EngineCoreOutput]:
        assert self._wake is not None, "start() first"
        while not self._pending:
            await self._wake.wait()
            self._wake.clear()
        outputs, self._pending = self._pending, []
        return outputs

    # ----------------------------------------------------------------- placing a request on a replica
    async def _place(self, stream: _Stream) -> None:
        """Send the stream's current attempt through the router (retrying while replicas fail)."""
        while not stream.ended:
            try:
                attempt = stream.attempt_request()
            except EngineDeadError as exc:
                self._fail(stream, exc)
                return
            stream.attempt_id = attempt.request_id
            self._by_attempt[attempt.request_id] = stream  # before the call: outputs may come first
            try:
                replica_id = await self._add.remote(attempt, self._subscriber, loads=self._loads())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - no replica took it: try again, then give up
                self._by_attempt.pop(attempt.request_id, None)
                if not await self._next_attempt(stream, exc):
                    return
                continue
            if stream.ended:  # aborted or finished while the call was in flight
                self._spawn(_with_timeout(self._abort.remote([attempt.request_id], target_replica=replica_id)))
                return
            stream.replica_id = replica_id
            self._on_replica.setdefault(replica_id, set()).add(stream.request.request_id)
            if stream.attempt == 0:
                self.counters.record_routed(stream.request, replica_id, set(self._statuses))
            self._subscribe(replica_id)
            return

    async def _next_attempt(self, stream: _Stream, exc: BaseException) -> bool:
        """Count and wait before the stream's next attempt; False (the stream failed) past MAX_ATTEMPTS."""
        if self._closed or stream.ended:
            return False
        if stream.attempt + 1 >= MAX_ATTEMPTS:
            self._fail(stream, exc)
            return False
        started = any(stream.tokens)
        if started:
            self.counters.resumes += 1
        else:
            self.counters.retries += 1
        logger.warning(
            "request %s: replica %s failed (%s); %s",
            stream.request.request_id,
            stream.replica_id,
            type(exc).__name__,
            "resuming it on another replica" if started else "retrying it",
        )
        await asyncio.sleep(RETRY_BACKOFF_S * (2**stream.attempt))
        stream.attempt += 1
        stream.replica_id = None
        return not stream.ended

    # ----------------------------------------------------------------- the replicas' output streams
    def _subscribe(self, replica_id: str) -> None:
        if replica_id not in self._subscriptions:
            task = asyncio.create_task(self._read_outputs(replica_id), name=f"outputs-{replica_id}")
            self._subscriptions[replica_id] = task

    async def _read_outputs(self, replica_id: str) -> None:
        error: BaseException = EngineDeadError(f"the output stream of replica {replica_id} ended")
        response = self._outputs.remote(self._subscriber, target_replica=replica_id)
        try:
            async for chunk in response:
                self._deliver(chunk.outputs)
        except asyncio.CancelledError:
            response.cancel()
            if self._closed:
                raise
            error = EngineDeadError(f"replica {replica_id} left the cluster")
        except Exception as exc:  # noqa: BLE001 - the replica died: its requests go elsewhere
            error = exc
        self._replica_failed(replica_id, error)

    def _replica_failed(self, replica_id: str, error: BaseException) -> None:
        self._subscriptions.pop(replica_id, None)
        self._statuses.pop(replica_id, None)
        for request_id in self._on_replica.pop(replica_id, set()):
            stream = self._streams.get(request_id)
            if stream is None or stream.ended:
                continue
            self._by_attempt.pop(stream.attempt_id, None)
            self._spawn(self._resume(stream, error))

    async def _resume(self, stream: _Stream, error: BaseException) -> None:
        if await self._next_attempt(stream, error):
            await self._place(stream)

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        delivered = False
        for output in outputs:
            stream = self._by_attempt.get(output.request_id)
            if stream is None or stream.ended:
                continue  # aborted, or from an attempt given up
            output.request_id = stream.request.request_id
            if output.first_scheduled_time is not None:
                output.first_scheduled_time = min(output.first_scheduled_time, now)
            stream.tokens[output.index].extend(output.new_token_ids)
            self._pending.append(output)
            delivered = True
            if output.finish_reason is not None:
                stream.finished.add(output.index)
                if stream.done:
                    self._end(stream, abort_on_replica=False)
        if delivered and self._wake is not None:
            self._wake.set()

    # ----------------------------------------------------------------- endings
    def _end(self, stream: _Stream, abort_on_replica: bool) -> None:
        stream.ended = True
        request_id = stream.request.request_id
        self._streams.pop(request_id, None)
        self._by_attempt.pop(stream.attempt_id, None)
        replica_id = stream.replica_id
        if replica_id is not None:
            placed = self._on_replica.get(replica_id)
            if placed is not None:
                placed.discard(request_id)
            if abort_on_replica:
                self._spawn(_with_timeout(self._abort.remote([stream.attempt_id], target_replica=replica_id)))

    def _fail(self, stream: _Stream, exc: BaseException) -> None:
        self.counters.failed += 1
        logger.error("request %s failed on every replica tried: %r", stream.request.request_id, exc)
        for index in range(len(stream.tokens)):
            if index not in stream.finished:
                stream.finished.add(index)
                self._pending.append(
                    EngineCoreOutput(stream.request.request_id, index, [], error=f"the engine replicas failed: {exc}")
                )
        self._end(stream, abort_on_replica=False)
        if self._wake is not None:
            self._wake.set()

    def _loads(self) -> dict[str, int]:
        return {replica_id: len(placed) for replica_id, placed in self._on_replica.items()}

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
            *(actor.record_routing_stats.remote() for actor in actors.values()), return_exceptions=True
        )
        for result in results:
            if isinstance(result, dict) and isinstance(result.get("status"), ReplicaStatus):
                status = result["status"]
                statuses[status.replica_id] = status
        self._statuses = statuses
        for replica_id, task in list(self._subscriptions.items()):
            if actors and replica_id not in actors:
                task.cancel()  # gone without the stream noticing: its requests are resumed

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


async def _with_timeout(call, timeout: float = 10.0) -> None:
    """Await a fire-and-forget call to one replica; one that is gone or slow is let go."""
    try:
        await asyncio.wait_for(call, timeout)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - the replica left; what it held went with it
        logger.debug("call to a replica failed", exc_info=True)


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
