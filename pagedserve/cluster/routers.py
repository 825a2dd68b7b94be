"""pagedserve's request routers on Ray Serve's custom-router API (``RequestRouter.choose_replicas``).

Ray builds one router per deployment handle, in the process that owns the handle (the front end), and
calls ``choose_replicas`` for every request; within a rank it sends the request to the replica with the
shortest queue that still accepts one. Load is counted here from the routing callbacks (requests routed
and not yet completed) and from the KV usage each replica publishes through ``record_routing_stats``.
"""

from __future__ import annotations

import itertools

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.cluster.routing_policy import (
    PrefixAffinityIndex,
    ReplicaLoad,
    least_loaded_ranks,
    prefix_affinity_ranks,
    prefix_chunk_hashes,
    round_robin_ranks,
)

MAX_RESERVATIONS = 4096  # requests being routed at once; beyond it (cancelled ones piling up) start afresh


class _CountingRouter(RequestRouter):
    """Counts the requests in flight per replica from Ray's routing callbacks, and the ones being routed.

    A burst of requests is routed before the first of them is acknowledged, so each choice reserves its
    replica at once (``_reserve``); the reservation becomes an in-flight request when Ray reports it routed.
    """

    def initialize_state(self, **kwargs) -> None:
        self._in_flight: dict[ReplicaID, int] = {}
        self._routed: dict[str, ReplicaID] = {}
        self._reserved: dict[str, ReplicaID] = {}
        self._reserved_count: dict[ReplicaID, int] = {}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = pending_request.metadata.internal_request_id
        self._unreserve(key)
        self._routed[key] = replica_id
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._routed.pop(internal_request_id, None) is not None:
            self._in_flight[replica_id] = max(0, self._in_flight.get(replica_id, 0) - 1)

    def _reserve(self, pending_request: PendingRequest | None, ranks: list[list[RunningReplica]]) -> None:
        if pending_request is None or not ranks or not ranks[0]:
            return
        key = pending_request.metadata.internal_request_id
        self._unreserve(key)
        if len(self._reserved) >= MAX_RESERVATIONS:
            self._reserved.clear()
            self._reserved_count.clear()
        replica_id = ranks[0][0].replica_id
        self._reserved[key] = replica_id
        self._reserved_count[replica_id] = self._reserved_count.get(replica_id, 0) + 1

    def _unreserve(self, key: str) -> None:
        replica_id = self._reserved.pop(key, None)
        if replica_id is not None:
            self._reserved_count[replica_id] = max(0, self._reserved_count.get(replica_id, 0) - 1)

    def _load_of(self, replica_id: ReplicaID) -> int:
        return self._in_flight.get(replica_id, 0) + self._reserved_count.get(replica_id, 0)

    def _loads(self, candidates: list[RunningReplica]) -> list[ReplicaLoad]:
        loads = []
        for replica in candidates:
            stats = replica.routing_stats or {}
            loads.append(
                ReplicaLoad(replica.replica_id, self._load_of(replica.replica_id), float(stats.get("kv_usage", 0.0)))
            )
        return loads

    @staticmethod
    def _as_replicas(ranks: list[list[ReplicaID]], candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id: replica for replica in candidates}
        return [[by_id[replica_id] for replica_id in rank if replica_id in by_id] for rank in ranks]


class RoundRobinRouter(_CountingRouter):
    """Each request to the next replica in turn (a full one is passed over)."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._counter = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        ranks = round_robin_ranks([replica.replica_id for replica in ordered], next(self._counter))
        chosen = self._as_replicas(ranks, candidate_replicas)
        self._reserve(pending_request, chosen)
        return chosen


class LeastLoadedRouter(_CountingRouter):
    """The replica with the fewest requests in flight (running + waiting), nearly full KV caches last."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ranks = self._as_replicas(least_loaded_ranks(self._loads(candidate_replicas)), candidate_replicas)
        self._reserve(pending_request, ranks)
        return ranks


class PrefixAffinityRouter(_CountingRouter):
    """The replica that was last sent the prompt's longest known prefix (its prefix cache likely holds it),
    unless that replica is ``imbalance_threshold`` requests busier than the least loaded one; else least-loaded.
    """

    def initialize_state(self, imbalance_threshold: int = 8, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._threshold = imbalance_threshold
        self._index = PrefixAffinityIndex()
        self._pending_hashes: dict[str, list[int]] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hashes = self._hashes_of(pending_request)
        ranks, _ = prefix_affinity_ranks(self._index, hashes, self._loads(candidate_replicas), self._threshold)
        chosen = self._as_replicas(ranks, candidate_replicas)
        self._reserve(pending_request, chosen)
        return chosen

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        hashes = self._pending_hashes.pop(pending_request.metadata.internal_request_id, None)
        if hashes is None:
            hashes = self._hashes_of(pending_request, remember=False)
        if hashes:
            self._index.record(hashes, replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        live = {replica.replica_id for replica in replicas}
        for gone in set(self._in_flight) - live:
            self._index.forget(gone)
            self._in_flight.pop(gone, None)
        super().update_replicas(replicas)

    def _hashes_of(self, pending_request: PendingRequest | None, remember: bool = True) -> list[int]:
        if pending_request is None or not pending_request.args:
            return []
        key = pending_request.metadata.internal_request_id
        cached = self._pending_hashes.get(key)
        if cached is not None:
            return cached
        request = pending_request.args[0]
        token_ids = getattr(request, "prompt_token_ids", None)
        hashes = prefix_chunk_hashes(token_ids) if token_ids else []
        if remember:
            self._pending_hashes[key] = hashes
        return hashes


ROUTER_CLASSES = {
    "round-robin": RoundRobinRouter,
    "least-loaded": LeastLoadedRouter,
    "prefix-affinity": PrefixAffinityRouter,
}
