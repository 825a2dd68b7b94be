"""Routing decisions over replica load, without Ray: round-robin order, least-loaded ranks and the
prefix-affinity index (which replica most likely holds a prompt's leading tokens in its prefix cache).

Load is what the front end knows exactly: the requests it has routed to each replica and not yet seen
finish (running + waiting there), plus each replica's last published KV-cache usage.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

PREFIX_CHUNK_TOKENS = 16  # affinity granularity: prompts sharing fewer leading tokens are not matched
MAX_PREFIX_CHUNKS = 256  # the first 4096 tokens decide
KV_FULL = 0.95  # a replica whose KV cache is this full is tried after the others


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One candidate: its id, requests in flight on it (from this front end), its KV-cache usage."""

    replica_id: Hashable
    in_flight: int
    kv_usage: float = 0.0


def least_loaded_ranks(loads: Sequence[ReplicaLoad]) -> list[list[Hashable]]:
    """Replicas by fewest requests in flight, the ones with a nearly full KV cache last."""
    roomy = sorted((load for load in loads if load.kv_usage < KV_FULL), key=lambda load: load.in_flight)
    full = sorted((load for load in loads if load.kv_usage >= KV_FULL), key=lambda load: load.in_flight)
    return [[load.replica_id] for load in roomy + full]


def prefix_chunk_hashes(
    token_ids: Sequence[int], chunk: int = PREFIX_CHUNK_TOKENS, cache_salt: str | None = None
) -> list[int]:
    """Chained hashes of the prompt's whole leading chunks: entry i covers tokens [0, (i + 1) * chunk).
    A ``cache_salt`` starts the chain, as it enters the first block's hash in the engine: requests of
    different salts share no prefix-cache block, so they never match each other here either."""
    hashes: list[int] = []
    parent = hash(("cache_salt", cache_salt)) if cache_salt else 0
    limit = min(len(token_ids) // chunk, MAX_PREFIX_CHUNKS)
    for i in range(limit):
        parent = hash((parent, tuple(token_ids[i * chunk : (i + 1) * chunk])))
        hashes.append(parent)
    return hashes


class PrefixAffinityIndex:
    """Chained prefix-chunk hash -> the replica last sent a prompt with that prefix (bounded LRU)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, Hashable] = OrderedDict()

    def match(self, hashes: Sequence[int], live: set[Hashable]) -> tuple[Hashable | None, int]:
        """The live replica holding the longest matched prefix, and how many chunks matched."""
        owner = self._owner
        low, high = 0, len(hashes)  # chained hashes: a match at i implies matches before i (binary search)
        best: Hashable | None = None
        while low < high:
            mid = (low + high) // 2
            replica = owner.get(hashes[mid])
            if replica is not None and replica in live:
                best, low = replica, mid + 1
            else:
                high = mid
        return best, low

    def record(self, hashes: Sequence[int], replica_id: Hashable) -> None:
        owner = self._owner
        for value in hashes:
            owner[value] = replica_id
            owner.move_to_end(value)
        while len(owner) > self.capacity:
            owner.popitem(last=False)

    def forget(self, replica_id: Hashable) -> None:
        """Drop a replica that left (its cache went with it)."""
        for key in [key for key, owner in self._owner.items() if owner == replica_id]:
            del self._owner[key]

    def __len__(self) -> int:
        return len(self._owner)


def prefix_affinity_ranks(
    index: PrefixAffinityIndex, hashes: Sequence[int], loads: Sequence[ReplicaLoad], imbalance_threshold: int
) -> tuple[list[list[Hashable]], bool]:
    """The replica holding the prompt's prefix first (unless it has ``imbalance_threshold`` more requests in
    flight than the least loaded one, or a full KV cache), then the others least-loaded first.
    Returns the ranks and whether the prefix decided the first one."""
    by_id = {load.replica_id: load for load in loads}
    fallback = least_loaded_ranks(loads)
    if not hashes:
        return fallback, False
    owner, matched = index.match(hashes, set(by_id))
    if owner is None or matched == 0:
        return fallback, False
    least = min(load.in_flight for load in loads)
    chosen = by_id[owner]
    if chosen.in_flight - least > imbalance_threshold or chosen.kv_usage >= KV_FULL:
        return fallback, False
    return [[owner]] + [rank for rank in fallback if rank != [owner]], True


def round_robin_ranks(replica_ids: Sequence[Hashable], counter: int) -> list[list[Hashable]]:
    """Replica ``counter mod n`` first, then the rest in order (tried when the first is full)."""
    if not replica_ids:
        return []
    start = counter % len(replica_ids)
    ordered = list(replica_ids[start:]) + list(replica_ids[:start])
    return [[replica_id] for replica_id in ordered]
