"""EngineReplica: one engine as a Ray Serve replica. It builds an engine core (the paged engine steps in
a spawned child process; ``--engine hf`` in a thread), warms it up before Serve routes to it, and streams
each request's engine-core outputs back as ``ReplicaChunk`` batches. A cancelled stream (the client went
away) aborts its request; a dead engine core fails the health check, so Serve replaces the replica.
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


class _RequestBox:
    """One request's outputs not yet streamed, and a wake-up for its stream."""

    __slots__ = ("outputs", "ready", "error")

    def __init__(self) -> None:
        self.outputs: list[EngineCoreOutput] = []
        self.ready = asyncio.Event()
        self.error: BaseException | None = None

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


class EngineReplica:
    """The body of an engine deployment (``factory.py`` wraps it with ``serve.deployment``)."""

    async def __init__(self, spec: ModelSpec) -> None:
        import ray
        from ray import serve

        if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":  # set by the factory's local instance
            _bind_replica_grpc_to_loopback()
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        node_id = ray.get_runtime_context().get_node_id()
        self._node = next(
            (node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id), node_id
        )  # the address the node advertises to the cluster
        core_kind = "thread" if spec.engine == "hf" else "process"
        self._core = await asyncio.to_thread(
            make_engine_core_client, spec.engine_config, engine=spec.engine, core=core_kind, start_method="spawn"
        )
        await self._core.warmup()
        await self._core.start()
        self._boxes: dict[str, _RequestBox] = {}
        self._dispatcher = asyncio.create_task(self._dispatch(), name="replica-dispatch")
        logger.info("replica %s of %r ready (engine pid %d)", self._replica_id, spec.name, self._core.pid)

    # ----------------------------------------------------------------- the streaming call
    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[ReplicaChunk, None]:
        """Stream one request's outputs until every sample finished; abort it if the caller goes away."""
        if self._core.is_dead:
            raise EngineDeadError(f"the engine core of replica {self._replica_id} is dead")
        request_id = request.request_id
        box = _RequestBox()
        self._boxes[request_id] = box
        remaining = request.sampling_params.n
        try:
            await self._core.add_request(request)
            while remaining > 0:
                outputs = await box.take()
                remaining -= sum(1 for output in outputs if output.finish_reason is not None)
                yield ReplicaChunk(self._replica_id, outputs)
        finally:
            self._boxes.pop(request_id, None)
            if remaining > 0 and not self._core.is_dead:
                await self._core.abort_requests([request_id])

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
        return {"kv_usage": status.stats.kv_cache_usage, "status": status}

    async def __del__(self) -> None:
        dispatcher = getattr(self, "_dispatcher", None)  # absent when the constructor failed
        if dispatcher is not None:
            dispatcher.cancel()
        core = getattr(self, "_core", None)
        if core is not None:
            await core.shutdown()

    # ----------------------------------------------------------------- internals
    async def _dispatch(self) -> None:
        boxes = self._boxes
        try:
            while True:
                for output in await self._core.get_outputs():
                    box = boxes.get(output.request_id)
                    if box is not None:
                        box.outputs.append(output)
                        box.ready.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the core died: fail every stream, the health check follows
            logger.error("replica %s: engine core failed: %r", self._replica_id, exc)
            for box in boxes.values():
                box.error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc))
                box.ready.set()
