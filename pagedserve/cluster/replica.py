"""EngineReplica: one engine as a Ray Serve replica. It builds an engine core (the paged engine steps in
a spawned child process; ``--engine hf`` in a thread) and warms it up before Serve routes to it.

Requests arrive one unary ``add`` call each (the request router picks the replica); their outputs leave
through one long-lived ``outputs`` stream per front end (``subscriber``): one batch per engine step for
all of that front end's requests on this replica, not one message per request and token. ``abort`` and
``stop`` are sent to the replica that holds the request. A front end whose stream goes away has its
requests aborted; a dead engine core ends every stream and fails the health check, so Serve replaces
the replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator

from pagedserve.cluster.wire import ReplicaChunk
from pagedserve.config import ModelSpec
from pagedserve.engine.core_client import EngineDeadError, make_engine_core_client
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, ReplicaStatus

logger = logging.getLogger("pagedserve.replica")


class _SubscriberBox:
    """Outputs not yet streamed to one front end, and the wake-up of its stream."""

    __slots__ = ("outputs", "ready", "error", "streaming")

    def __init__(self) -> None:
        self.outputs: list[EngineCoreOutput] = []
        self.ready = asyncio.Event()
        self.error: BaseException | None = None
        self.streaming = False

    async def take(self) -> list[EngineCoreOutput]:
        while not self.outputs and self.error is None:
            await self.ready.wait()
        self.ready.clear()
        if self.error is not None:
            raise self.error
        outputs, self.outputs = self.outputs, []
        return outputs


def _bind_replica_grpc_to_loopback() -> None:
    """In a loopback-only local Ray instance, the replica's inter-deployment gRPC server binds 127.0.0.1.

    NOTE: Ray Serve 2.60 binds that server to ``[::]:0`` (every interface) whatever the node's address;
    the replacement runs in this replica's process only, before Serve starts the server (after the
    constructor). Replicas on a real cluster (``--ray-address``) keep Ray's behaviour.
    """
    from ray.serve._private import replica as serve_replica

    bind = serve_replica.add_port_to_grpc_server
    if getattr(bind, "loopback_only", False):
        return

    def bind_loopback(server, address: str):
        return bind(server, address.replace("[::]", "127.0.0.1"))

    bind_loopback.loopback_only = True
    serve_replica.add_port_to_grpc_server = bind_loopback


def _replica_cpus(rank, cpus_per_replica: float) -> list[int] | None:
    """The cores this replica's engine is pinned to: ``cpus_per_replica`` of them from the replica's rank
    on its node (``local_rank``); None (not pinned) for a fractional share or more than the node has."""
    count = int(cpus_per_replica)
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if count != cpus_per_replica or count < 1 or count > len(available) or rank is None:
        return None
    first = (getattr(rank, "local_rank", 0) * count) % len(available)
    return [available[(first + k) % len(available)] for k in range(count)]


def _start_engine_core(spec: ModelSpec, cpus: list[int] | None):
    """Build the engine core (blocking; in a worker thread). The paged engine's process is spawned from this
    thread, so it inherits the thread's CPU mask: pinning the thread first pins every engine thread."""
    core_kind = "thread" if spec.engine == "hf" else "process"
    if not cpus:
        return make_engine_core_client(spec.engine_config, engine=spec.engine, core=core_kind, start_method="spawn")
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # this thread only (Linux)
    try:
        return make_engine_core_client(spec.engine_config, engine=spec.engine, core=core_kind, start_method="spawn")
    finally:
        os.sched_setaffinity(0, mask)


class EngineReplica:
    """The body of an engine deployment (``factory.py`` wraps it with ``serve.deployment``)."""

    async def __init__(self, spec: ModelSpec, cpus_per_replica: float = 0.0) -> None:
        import ray
        from ray import serve

        if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":  # set by the factory's local instance
            _bind_replica_grpc_to_loopback()
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        node_id = ray.get_runtime_context().get_node_id()
        self._node = next(
            (node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id), node_id
        )  # the address the node advertises to the cluster
        cpus = _replica_cpus(serve.get_replica_context().rank, cpus_per_replica)
        self._core = await asyncio.to_thread(_start_engine_core, spec, cpus)
        await self._core.warmup()
        await self._core.start()
        self._boxes: dict[str, _SubscriberBox] = {}
        self._owner: dict[str, str] = {}  # request id -> subscriber
        self._remaining: dict[str, int] = {}  # request id -> samples not finished
        self._dispatcher = asyncio.create_task(self._dispatch(), name="replica-dispatch")
        logger.info(
            "replica %s of %r ready (engine pid %d, cores %s)", self._replica_id, spec.name, self._core.pid, cpus
        )

    # ----------------------------------------------------------------- calls from the front end
    async def add(self, request: EngineCoreRequest, subscriber: str, loads: dict | None = None) -> str:
        """Queue a request whose outputs go to ``subscriber``'s stream; returns this replica's id.

        ``loads`` is the front end's load per replica (requests in flight, prompt tokens still waiting for
        a first token), read by the request router only.
        """
        if self._core.is_dead:
            raise EngineDeadError(f"the engine core of replica {self._replica_id} is dead")
        request_id = request.request_id
        self._box(subscriber)
        self._owner[request_id] = subscriber
        self._remaining[request_id] = request.sampling_params.n
        await self._core.add_request(request)
        return self._replica_id

    async def outputs(self, subscriber: str, target_replica: str | None = None) -> AsyncGenerator[ReplicaChunk, None]:
        """Stream ``subscriber``'s outputs, one batch per engine step, until it goes away (then its
        requests here are aborted)."""
        box = self._box(subscriber)
        box.streaming = True
        try:
            while True:
                yield ReplicaChunk(self._replica_id, await box.take())
        finally:
            self._boxes.pop(subscriber, None)
            orphans = [request_id for request_id, owner in self._owner.items() if owner == subscriber]
            if orphans and not self._core.is_dead:
                await self.abort(orphans)

    async def abort(self, request_ids: list[str], target_replica: str | None = None) -> None:
        for request_id in request_ids:
            self._owner.pop(request_id, None)
            self._remaining.pop(request_id, None)
        if not self._core.is_dead:
            await self._core.abort_requests(list(request_ids))

    async def stop(self, samples: list[tuple[str, int]], target_replica: str | None = None) -> None:
        if not self._core.is_dead:
            await self._core.stop_samples(list(samples))

    async def model_info(self) -> ModelInfo:
        return self._core.model_info

    # ----------------------------------------------------------------- Serve hooks
    async def check_health(self) -> None:
        if self._core.is_dead:
            raise RuntimeError(f"the engine core of replica {self._replica_id} died")

    async def record_routing_stats(self) -> dict:
        """Published to the routers (every ``request_routing_stats_period_s``) and read by the front end."""
        if not hasattr(self, "_dispatcher"):
            return {}  # still starting
        status = ReplicaStatus(self._replica_id, self._core.pid or os.getpid(), self._node, self._core.get_stats())
        return {
            "kv_usage": status.stats.kv_cache_usage,
            "kv_capacity_tokens": status.stats.kv_capacity_tokens,
            "status": status,
        }

    async def __del__(self) -> None:
        dispatcher = getattr(self, "_dispatcher", None)  # absent when the constructor failed
        if dispatcher is not None:
            dispatcher.cancel()
        core = getattr(self, "_core", None)
        if core is not None:
            await core.shutdown()

    # ----------------------------------------------------------------- internals
    def _box(self, subscriber: str) -> _SubscriberBox:
        box = self._boxes.get(subscriber)
        if box is None:
            box = self._boxes[subscriber] = _SubscriberBox()
        return box

    async def _dispatch(self) -> None:
        boxes, owner, remaining = self._boxes, self._owner, self._remaining
        try:
            while True:
                woken = set()
                for output in await self._core.get_outputs():
                    request_id = output.request_id
                    subscriber = owner.get(request_id)
                    box = boxes.get(subscriber) if subscriber is not None else None
                    if box is None:
                        continue
                    box.outputs.append(output)
                    woken.add(subscriber)
                    if output.finish_reason is not None:
                        left = remaining.get(request_id, 1) - 1
                        if left <= 0:
                            owner.pop(request_id, None)
                            remaining.pop(request_id, None)
                        else:
                            remaining[request_id] = left
                for subscriber in woken:
                    boxes[subscriber].ready.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the core died: end every stream, the health check follows
            logger.error("replica %s: engine core failed: %r", self._replica_id, exc)
            for box in boxes.values():
                box.error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc))
                box.ready.set()
