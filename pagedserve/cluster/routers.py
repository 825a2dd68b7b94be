"""pagedserve's request routers on Ray Serve's custom-router API (``RequestRouter.choose_replicas``).

Ray builds one router per deployment handle, in the process that owns the handle (the front end), and
calls ``choose_replicas`` for every call. A request's ``add`` call carries the front end's loads per
replica (``loads``: requests in flight and the prompt tokens of those still waiting for a first token; the
front end sees every token arrive and every request finish, Ray only sees the short ``add`` call); calls
meant for one replica (its output stream, an abort) carry ``target_replica`` and go there. The KV usage and
size each replica publishes through ``record_routing_stats`` put nearly full replicas last and bound what
the prefix-affinity index believes a replica still holds.
"""

from __future__ import annotations

import itertools

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.cluster.routing_policy import (
    PREFIX_CHUNK_TOKENS,
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


def _prompt_tokens(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    return getattr(pending_request.args[0], "prompt_token_ids", None) or []


class _LoadAwareRouter(RequestRouter):
    """Targeted calls to their replica; requests by a policy over the front end's loads.

    A burst of requests is routed before the first ``add`` returns, so each choice also reserves its
    replica (counted as load: one request and its prompt's tokens) until Ray reports the call routed.
    """

    def initialize_state(self, **kwargs) -> None:
        self._reserved: dict[str, tuple[ReplicaID, int]] = {}  # request -> (replica, prompt tokens)

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
        self._reserved.pop(pending_request.metadata.internal_request_id, None)

    # ----------------------------------------------------------------- internals
    def _loads(self, candidates: list[RunningReplica], front_end_loads: dict) -> list[ReplicaLoad]:
        reserved_load: dict[ReplicaID, tuple[int, int]] = {}  # replica -> (requests, prompt tokens) reserved
        for replica_id, tokens in self._reserved.values():
            requests, reserved_tokens = reserved_load.get(replica_id, (0, 0))
            reserved_load[replica_id] = (requests + 1, reserved_tokens + tokens)
        loads = []
        for replica in candidates:
            stats = replica.routing_stats or {}
            in_flight, prefill_tokens = front_end_loads.get(replica.replica_id.unique_id, (0, 0))
            reserved, reserved_tokens = reserved_load.get(replica.replica_id, (0, 0))
            kv_usage = float(stats.get("kv_usage", 0.0))
            loads.append(
                ReplicaLoad(replica.replica_id, in_flight + reserved, kv_usage, prefill_tokens + reserved_tokens)
            )
        return loads

    @staticmethod
    def _as_replicas(ranks: list[list[ReplicaID]], candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id: replica for replica in candidates}
        return [[by_id[replica_id] for replica_id in rank if replica_id in by_id] for rank in ranks]

    def _reserve(self, pending_request: PendingRequest | None, ranks: list[list[RunningReplica]]) -> None:
        if pending_request is None or not ranks or not ranks[0]:
            return
        if len(self._reserved) >= MAX_RESERVATIONS:
            self._reserved.clear()
        key = pending_request.metadata.internal_request_id
        self._reserved[key] = (ranks[0][0].replica_id, len(_prompt_tokens(pending_request)))


class RoundRobinRouter(_LoadAwareRouter):
    """Each request to the next replica in turn (a full one is passed over)."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._counter = itertools.count()

    def rank(self, loads: list[ReplicaLoad], pending_request: PendingRequest | None) -> list[list[ReplicaID]]:
        ordered = sorted((load.replica_id for load in loads), key=lambda replica_id: replica_id.unique_id)
        return round_robin_ranks(ordered, next(self._counter))


class LeastLoadedRouter(_LoadAwareRouter):
    """The replica with the fewest requests in flight (running + waiting; then the least prefill queued),
    nearly full KV caches last."""

    def rank(self, loads: list[ReplicaLoad], pending_request: PendingRequest | None) -> list[list[ReplicaID]]:
        return least_loaded_ranks(loads)


class PrefixAffinityRouter(_LoadAwareRouter):
    """The replica that was last sent the prompt's longest known prefix (its prefix cache likely holds it),
    when that prefix is most of the prompt and the replica is at most ``imbalance_threshold`` requests busier
    than the least loaded one; else the replica with the least prefill queued (``prefix_affinity_ranks``).
    """

    def initialize_state(self, imbalance_threshold: int = 8, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._threshold = imbalance_threshold
        self._index = PrefixAffinityIndex()
        self._hashes: dict[str, list[int]] = {}  # requests being routed -> their prefix hashes
        self._cache_chunks: dict[ReplicaID, int] = {}  # replica -> its KV cache in prefix chunks (published)

    def rank(self, loads: list[ReplicaLoad], pending_request: PendingRequest | None) -> list[list[ReplicaID]]:
        hashes = self._hashes_of(pending_request)
        prompt_tokens = len(_prompt_tokens(pending_request))
        ranks, _ = prefix_affinity_ranks(self._index, hashes, loads, self._threshold, prompt_tokens)
        return ranks

    def _loads(self, candidates: list[RunningReplica], front_end_loads: dict) -> list[ReplicaLoad]:
        for replica in candidates:
            capacity = int((replica.routing_stats or {}).get("kv_capacity_tokens", 0))
            if capacity:
                self._cache_chunks[replica.replica_id] = capacity // PREFIX_CHUNK_TOKENS
        return super()._loads(candidates, front_end_loads)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        if "target_replica" in _kwargs(pending_request):
            return
        hashes = self._hashes.pop(pending_request.metadata.internal_request_id, None)
        if hashes is None:
            hashes = self._hashes_of(pending_request, remember=False)
        if hashes:
            self._index.record(hashes, replica_id, self._cache_chunks.get(replica_id, 0))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        live = {replica.replica_id for replica in replicas}
        for gone in set(getattr(self, "_known", ())) - live:
            self._index.forget(gone)
            self._cache_chunks.pop(gone, None)
        self._known = live
        super().update_replicas(replicas)

    def _hashes_of(self, pending_request: PendingRequest | None, remember: bool = True) -> list[int]:
        if pending_request is None or not pending_request.args:
            return []
        key = pending_request.metadata.internal_request_id
        cached = self._hashes.get(key)
        if cached is not None:
            return cached
        token_ids = _prompt_tokens(pending_request)
        cache_salt = getattr(pending_request.args[0], "cache_salt", None)
        hashes = prefix_chunk_hashes(token_ids, cache_salt=cache_salt) if token_ids else []
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
