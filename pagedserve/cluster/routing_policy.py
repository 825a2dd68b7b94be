"""Routing decisions over replica load, without Ray: round-robin order, least-loaded ranks and the
prefix-affinity index (which replica most likely holds a prompt's leading tokens in its prefix cache).

Load is what the front end knows exactly: the requests it has routed to each replica and not yet seen
finish (running + waiting there), the prompt tokens of those that have had no first token yet (the prefill
work queued there), plus each replica's last published KV-cache usage and size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

PREFIX_CHUNK_TOKENS = 16  # affinity granularity: prompts sharing fewer leading tokens are not matched
MAX_PREFIX_CHUNKS = 256  # the first 4096 tokens decide
KV_FULL = 0.95  # a replica whose KV cache is this full is tried after the others
MIN_MATCH_RATIO = 0.5  # a known prefix decides only when it covers this share of the prompt (as SGLang's router)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One candidate: its id, requests in flight on it (from this front end), its KV-cache usage, and the
    prompt tokens of its requests in flight that have not had a first token yet."""

    replica_id: Hashable
    in_flight: int
    kv_usage: float = 0.0
    prefill_tokens: int = 0


def least_loaded_ranks(loads: Sequence[ReplicaLoad]) -> list[list[Hashable]]:
    """Replicas by fewest requests in flight (then least prefill queued), the ones with a nearly full KV
    cache last."""
    return _ranked(loads, key=lambda load: (load.in_flight, load.prefill_tokens))


def least_prefill_ranks(loads: Sequence[ReplicaLoad]) -> list[list[Hashable]]:
    """Replicas by least prompt work queued ahead (then fewest requests in flight), nearly full KV caches
    last: where a prompt that must be computed from its first token gets that token soonest."""
    return _ranked(loads, key=lambda load: (load.prefill_tokens, load.in_flight))


def _ranked(loads: Sequence[ReplicaLoad], key) -> list[list[Hashable]]:
    roomy = sorted((load for load in loads if load.kv_usage < KV_FULL), key=key)
    full = sorted((load for load in loads if load.kv_usage >= KV_FULL), key=key)
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
    """Chained prefix-chunk hash -> the replica last sent a prompt with that prefix.

    Each replica's chunks are kept in least-recently-sent order and bounded by what its KV cache holds, so
    a prefix pushed out by newer prompts stops matching there, as it has most likely left that replica's
    prefix cache too. A prompt's tail chunks go first (its leading ones are the most recently used), as
    the engine evicts a freed request's blocks last-first: what remains matchable is always a prefix.
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity  # chunks per replica when its cache size is unknown
        self._owner: dict[int, Hashable] = {}
        self._held: dict[Hashable, OrderedDict[int, None]] = {}  # replica -> its chunks, least recent first

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

    def record(self, hashes: Sequence[int], replica_id: Hashable, replica_chunks: int = 0) -> None:
        """``replica_id`` was sent a prompt with these chunks; it holds ``replica_chunks`` of them at most
        (its KV cache in chunks; 0 when not known)."""
        owner = self._owner
        held = self._held.setdefault(replica_id, OrderedDict())
        for value in reversed(hashes):
            previous = owner.get(value)
            if previous is not None and previous != replica_id:
                self._held[previous].pop(value, None)
            owner[value] = replica_id
            held[value] = None
            held.move_to_end(value)
        limit = min(replica_chunks, self.capacity) if replica_chunks > 0 else self.capacity
        while len(held) > limit:
            value, _ = held.popitem(last=False)
            del owner[value]

    def forget(self, replica_id: Hashable) -> None:
        """Drop a replica that left (its cache went with it)."""
        for value in self._held.pop(replica_id, {}):
            del self._owner[value]

    def __len__(self) -> int:
        return len(self._owner)


def prefix_affinity_ranks(
    index: PrefixAffinityIndex,
    hashes: Sequence[int],
    loads: Sequence[ReplicaLoad],
    imbalance_threshold: int,
    prompt_tokens: int = 0,
    min_match_ratio: float = MIN_MATCH_RATIO,
) -> tuple[list[list[Hashable]], bool]:
    """The replica holding the prompt's prefix first, then the others least-prefill first.

    The prefix decides when it covers at least ``min_match_ratio`` of the prompt (of its first
    ``MAX_PREFIX_CHUNKS`` chunks; a shared system prompt alone does not tie every chat to one replica) and
    its replica has at most ``imbalance_threshold`` more requests in flight than the least loaded one and
    a KV cache that is not full. Otherwise the prompt is computed from the start wherever it goes, so it
    goes where the least prompt work is queued ahead of it. Returns the ranks and whether the prefix
    decided the first one."""
    by_id = {load.replica_id: load for load in loads}
    fallback = least_prefill_ranks(loads)
    if not hashes:
        return fallback, False
    owner, matched = index.match(hashes, set(by_id))
    considered = min(prompt_tokens or len(hashes) * PREFIX_CHUNK_TOKENS, MAX_PREFIX_CHUNKS * PREFIX_CHUNK_TOKENS)
    if owner is None or matched == 0 or matched * PREFIX_CHUNK_TOKENS < min_match_ratio * considered:
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
