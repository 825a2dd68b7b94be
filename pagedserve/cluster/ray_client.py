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


class _Part:
    """One engine request carrying samples of a stream: all of them (``index`` None, outputs keep their
    index), or one resumed sample ``index`` (sent with n = 1: its index 0 is that sample)."""

    __slots__ = ("request", "index", "replica_id", "started")

    def __init__(self, request: EngineCoreRequest, index: int | None) -> None:
        self.request = request
        self.index = index
        self.replica_id: str | None = None  # where it runs, once placed
        self.started = False  # a first output came back: its prompt is computed

    @property
    def attempt_id(self) -> str:
        return self.request.request_id


class _Stream:
    """One request on the cluster: what the client has been sent so far per sample, and its parts."""

    __slots__ = ("request", "tokens", "finished", "parts", "attempt", "ended", "_next_id")

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request = request
        n = request.sampling_params.n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finished: set[int] = set()
        self.parts: dict[str, _Part] = {}  # attempt id -> part in flight
        self.attempt = 0  # failures survived so far
        self.ended = False  # finished, aborted or failed: nothing more goes to the client
        self._next_id = 0

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.tokens)

    def first_part(self) -> _Part:
        return _Part(self.request, None)

    def parts_after_failure(self, failed: _Part) -> list[_Part]:
        """What replaces ``failed``: the same request again if nothing of it was delivered, else each of its
        unfinished samples resumed from its prompt plus the tokens already delivered."""
        indices = range(len(self.tokens)) if failed.index is None else [failed.index]
        unfinished = [index for index in indices if index not in self.finished]
        if failed.index is None and not any(self.tokens[index] for index in unfinished):
            return [_Part(dataclasses.replace(self.request, request_id=self._attempt_id()), None)]
        return [_Part(self._resumed(index), index) for index in unfinished]

    def _resumed(self, index: int) -> EngineCoreRequest:
        request, delivered = self.request, self.tokens[index]
        params = request.sampling_params
        resumed = dataclasses.replace(
            params,
            n=1,
            max_tokens=None if params.max_tokens is None else params.max_tokens - len(delivered),
            min_tokens=max(0, params.min_tokens - len(delivered)),
            prompt_logprobs=None,  # sent with the first token already
        )
        return dataclasses.replace(
            request,
            request_id=self._attempt_id(),
            prompt_token_ids=request.prompt_token_ids + delivered,
            sampling_params=resumed,
        )

    def _attempt_id(self) -> str:
        self._next_id += 1
        return f"{self.request.request_id}~{self._next_id}"


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
        hashes = prefix_chunk_hashes(request.prompt_token_ids, cache_salt=request.cache_salt)
        if hashes:
            owner, matched = self._index.match(hashes, live | {replica_id})
            if owner is not None and matched:
                self.prefix_queries += 1
                self.prefix_hits += owner == replica_id
            self._index.record(hashes, replica_id)


class RayEngineCoreClient(EngineCoreClient):
    """EngineCoreClient over the replicas of one Ray Serve application (one served model)."""

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
        self._by_attempt: dict[str, tuple[_Stream, _Part]] = {}  # the request id a part was sent with
        self._on_replica: dict[str, set[str]] = {}  # replica id -> the parts (their request ids) placed there
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
        self._spawn(self._place(stream, stream.first_part()))

    async def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._end(stream, abort_on_replica=True)

    async def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        """Stop strings matched in the front end: stop those samples; end the request once all are done."""
        for request_id, index in samples:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            stream.finished.add(index)
            if stream.done:
                self._end(stream, abort_on_replica=True)
                continue
            for part in list(stream.parts.values()):
                if part.replica_id is None or part.index not in (None, index):
                    continue
                if part.index is None:
                    call = self._stop.remote([(part.attempt_id, index)], target_replica=part.replica_id)
                else:
                    self._drop_part(stream, part)
                    call = self._abort.remote([part.attempt_id], target_replica=part.replica_id)
                self._spawn(_with_timeout(call))

    async def get_outputs(self) -> list[EngineCoreOutput]:
        assert self._wake is not None, "start() first"
        while not self._pending:
            await self._wake.wait()
            self._wake.clear()
        outputs, self._pending = self._pending, []
        return outputs

    # ----------------------------------------------------------------- placing a request on a replica
    async def _place(self, stream: _Stream, part: _Part) -> None:
        """Send one part through the router (retrying while replicas fail)."""
        while not stream.ended:
            stream.parts[part.attempt_id] = part
            self._by_attempt[part.attempt_id] = (stream, part)  # before the call: outputs may come first
            try:
                replica_id = await self._add.remote(part.request, self._subscriber, loads=self.replica_loads())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - no replica took it: try again, then give up
                self._drop_part(stream, part)
                if not await self._next_attempt(stream, exc, None):
                    return
                replacements = stream.parts_after_failure(part)
                part = replacements[0]
                for other in replacements[1:]:
                    self._spawn(self._place(stream, other))
                continue
            if stream.ended or part.attempt_id not in stream.parts:  # ended or stopped while in flight
                self._spawn(_with_timeout(self._abort.remote([part.attempt_id], target_replica=replica_id)))
                return
            part.replica_id = replica_id
            self._on_replica.setdefault(replica_id, set()).add(part.attempt_id)
            if stream.attempt == 0 and part.index is None:
                self.counters.record_routed(stream.request, replica_id, set(self._statuses))
            self._subscribe(replica_id)
            return

    async def _next_attempt(self, stream: _Stream, exc: BaseException, replica_id: str | None) -> bool:
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
            replica_id,
            type(exc).__name__,
            "resuming it on another replica" if started else "retrying it",
        )
        await asyncio.sleep(RETRY_BACKOFF_S * (2**stream.attempt))
        stream.attempt += 1
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
        failed: dict[str, tuple[_Stream, list[_Part]]] = {}
        for attempt_id in self._on_replica.pop(replica_id, set()):
            entry = self._by_attempt.get(attempt_id)
            if entry is None or entry[0].ended:
                continue
            stream, part = entry
            self._drop_part(stream, part)
            failed.setdefault(stream.request.request_id, (stream, []))[1].append(part)
        for stream, parts in failed.values():
            self._spawn(self._resume(stream, parts, error, replica_id))

    async def _resume(self, stream: _Stream, failed: list[_Part], error: BaseException, replica_id: str) -> None:
        if not await self._next_attempt(stream, error, replica_id):
            return
        replacements = [new for part in failed for new in stream.parts_after_failure(part)]
        await asyncio.gather(*(self._place(stream, part) for part in replacements))

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        delivered = False
        for output in outputs:
            entry = self._by_attempt.get(output.request_id)
            if entry is None:
                continue  # aborted, stopped, or from a part given up
            stream, part = entry
            if stream.ended:
                continue
            part.started = True
            if part.index is not None:
                output.index = part.index
            if output.index in stream.finished:
                continue  # stopped by a stop string
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
                elif part.index is not None:
                    self._drop_part(stream, part)
        if delivered and self._wake is not None:
            self._wake.set()

    # ----------------------------------------------------------------- endings
    def _drop_part(self, stream: _Stream, part: _Part) -> None:
        stream.parts.pop(part.attempt_id, None)
        self._by_attempt.pop(part.attempt_id, None)
        if part.replica_id is not None:
            placed = self._on_replica.get(part.replica_id)
            if placed is not None:
                placed.discard(part.attempt_id)

    def _end(self, stream: _Stream, abort_on_replica: bool) -> None:
        stream.ended = True
        self._streams.pop(stream.request.request_id, None)
        for part in list(stream.parts.values()):
            self._drop_part(stream, part)
            if abort_on_replica and part.replica_id is not None:
                call = self._abort.remote([part.attempt_id], target_replica=part.replica_id)
                self._spawn(_with_timeout(call))

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

    def replica_loads(self) -> dict[str, tuple[int, int]]:
        """Per replica: the parts placed there, and the prompt tokens of those with no output yet."""
        loads = {}
        for replica_id, placed in self._on_replica.items():
            prefill_tokens = 0
            for attempt_id in placed:
                entry = self._by_attempt.get(attempt_id)
                if entry is not None and not entry[1].started:
                    prefill_tokens += len(entry[1].request.prompt_token_ids)
            loads[replica_id] = (len(placed), prefill_tokens)
        return loads

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
        if name == "kv_cache_usage":
            continue
        values = [getattr(stats, name) for stats in snapshots]
        if isinstance(values[0], tuple):  # per-bucket / per-position counts: summed column by column
            rows = [value for value in values if value]
            setattr(merged, name, tuple(sum(column) for column in zip(*rows)) if rows else ())
        else:
            setattr(merged, name, sum(values))
    total_blocks = sum(stats.num_blocks for stats in snapshots)
    if total_blocks:
        merged.kv_cache_usage = sum(stats.kv_cache_usage * stats.num_blocks for stats in snapshots) / total_blocks
    else:
        merged.kv_cache_usage = sum(stats.kv_cache_usage for stats in snapshots) / len(snapshots)
    return merged
