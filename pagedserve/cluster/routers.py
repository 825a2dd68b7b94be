"""pagedserve's request routers on Ray Serve's custom-router API (``RequestRouter.choose_replicas``).

Ray builds one router per deployment handle, in the process that owns the handle (the front end), and
calls ``choose_replicas`` for every call. A request's ``add`` call carries the front end's count of
requests in flight per replica (``loads``: the front end sees every request finish, Ray only sees the
short ``add`` call); calls meant for one replica (its output stream, an abort) carry ``target_replica``
and go there. The KV usage each replica publishes through ``record_routing_stats`` breaks near-ties.
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


def _kwargs(pending_request: PendingRequest | None) -> dict:
    return pending_request.kwargs if pending_request is not None and pending_request.kwargs else {}


class _LoadAwareRouter(RequestRouter):
    """Targeted calls to their replica; requests by a policy over the front end's loads.

    A burst of requests is routed before the first ``add`` returns, so each choice also reserves its
    replica (counted as load) until Ray reports the call routed.
    """

    def initialize_state(self, **kwargs) -> None:
        self._reserved: dict[str, ReplicaID] = {}
        self._reserved_count: dict[ReplicaID, int] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = _kwargs(pending_request)
        target = kwargs.get("target_replica")
        if target is not None:
            return [[replica for replica in candidate_replicas if replica.replica_id.unique_id == target]]
        loads = self._loads(candidate_replicas, kwargs.get("loads") or {})
        chosen = self._as_replicas(self.rank(loads, pending_request), candidate_replicas)
        self._reserve(pending_request, chosen)
        return chosen

    def rank(self, loads: list[ReplicaLoad], pending_request: PendingRequest | None) -> list[list[ReplicaID]]:
        raise NotImplementedError

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._unreserve(pending_request.metadata.internal_request_id)

    # ----------------------------------------------------------------- internals
    def _loads(self, candidates: list[RunningReplica], front_end_loads: dict) -> list[ReplicaLoad]:
        loads = []
        for replica in candidates:
            stats = replica.routing_stats or {}
            in_flight = front_end_loads.get(replica.replica_id.unique_id, 0)
            in_flight += self._reserved_count.get(replica.replica_id, 0)
            loads.append(ReplicaLoad(replica.replica_id, in_flight, float(stats.get("kv_usage", 0.0))))
        return loads

    @staticmethod
    def _as_replicas(ranks: list[list[ReplicaID]], candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id: replica for replica in candidates}
        return [[by_id[replica_id] for replica_id in rank if replica_id in by_id] for rank in ranks]

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


class RoundRobinRouter(_LoadAwareRouter):
    """Each request to the next replica in turn (a full one is passed over)."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._counter = itertools.count()

    def rank(self, loads: list[ReplicaLoad], pending_request: PendingRequest | None) -> list[list[ReplicaID]]:
        ordered = sorted((load.replica_id for load in loads), key=lambda replica_id: replica_id.unique_id)
        return round_robin_ranks(ordered, next(self._counter))


class LeastLoadedRouter(_LoadAwareRouter):
    """The replica with the fewest requests in flight (running + waiting), nearly full KV caches last."""

    def rank(self, loads: list[ReplicaLoad], pending_request: PendingRequest | None) -> list[list[ReplicaID]]:
        return least_loaded_ranks(loads)


class PrefixAffinityRouter(_LoadAwareRouter):
    """The replica that was last sent the prompt's longest known prefix (its prefix cache likely holds it),
    unless that replica is ``imbalance_threshold`` requests busier than the least loaded one; else least-loaded.
    """

    def initialize_state(self, imbalance_threshold: int = 8, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._threshold = imbalance_threshold
        self._index = PrefixAffinityIndex()
        self._hashes: dict[str, list[int]] = {}  # requests being routed -> their prefix hashes

    def rank(self, loads: list[ReplicaLoad], pending_request: PendingRequest | None) -> list[list[ReplicaID]]:
        ranks, _ = prefix_affinity_ranks(self._index, self._hashes_of(pending_request), loads, self._threshold)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        if "target_replica" in _kwargs(pending_request):
            return
        hashes = self._hashes.pop(pending_request.metadata.internal_request_id, None)
        if hashes is None:
            hashes = self._hashes_of(pending_request, remember=False)
        if hashes:
            self._index.record(hashes, replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        live = {replica.replica_id for replica in replicas}
        for gone in set(getattr(self, "_known", ())) - live:
            self._index.forget(gone)
        self._known = live
        super().update_replicas(replicas)

    def _hashes_of(self, pending_request: PendingRequest | None, remember: bool = True) -> list[int]:
        if pending_request is None or not pending_request.args:
            return []
        key = pending_request.metadata.internal_request_id
        cached = self._hashes.get(key)
        if cached is not None:
            return cached
        request = pending_request.args[0]
        token_ids = getattr(request, "prompt_token_ids", None)
        hashes = prefix_chunk_hashes(token_ids, cache_salt=getattr(request, "cache_salt", None)) if token_ids else []
        if remember:
            if len(self._hashes) >= MAX_RESERVATIONS:
                self._hashes.clear()
            self._hashes[key] = hashes
        return hashes


ROUTER_CLASSES = {
    "round-robin": RoundRobinRouter,
    "least-loaded": LeastLoadedRouter,
    "prefix-affinity": PrefixAffinityRouter,
}
