"""The routing decisions without Ray: round-robin order, least-loaded ranks, the prefix-affinity index
and its fall-back when the replica holding a prefix is too busy; and stats merged across replicas."""

from __future__ import annotations

from pagedserve.cluster.ray_client import RouterCounters, merge_stats
from pagedserve.cluster.routing_policy import (
    KV_FULL,
    MAX_PREFIX_CHUNKS,
    PREFIX_CHUNK_TOKENS,
    PrefixAffinityIndex,
    ReplicaLoad,
    least_loaded_ranks,
    least_prefill_ranks,
    prefix_affinity_ranks,
    prefix_chunk_hashes,
    round_robin_ranks,
)
from pagedserve.messages import EngineCoreRequest, SchedulerStats
from pagedserve.sampling_params import SamplingParams


def family(seed: int, length: int = 200) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(length)]


def test_round_robin_visits_every_replica_in_turn() -> None:
    firsts = [round_robin_ranks(["a", "b", "c"], counter)[0][0] for counter in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert round_robin_ranks(["a", "b"], 1) == [["b"], ["a"]]
    assert round_robin_ranks([], 3) == []


def test_least_loaded_orders_by_in_flight_and_puts_full_kv_last() -> None:
    loads = [ReplicaLoad("a", 5), ReplicaLoad("b", 1), ReplicaLoad("c", 0, kv_usage=KV_FULL), ReplicaLoad("d", 3)]
    assert least_loaded_ranks(loads) == [["b"], ["d"], ["a"], ["c"]]


def test_prefix_hashes_are_chained_whole_chunks() -> None:
    tokens = family(1, 3 * PREFIX_CHUNK_TOKENS + 5)
    hashes = prefix_chunk_hashes(tokens)
    assert len(hashes) == 3
    assert prefix_chunk_hashes(tokens[: 2 * PREFIX_CHUNK_TOKENS]) == hashes[:2]
    changed = list(tokens)
    changed[0] += 1  # a different first token changes every chained hash
    assert not set(prefix_chunk_hashes(changed)) & set(hashes)
    assert prefix_chunk_hashes(tokens[: PREFIX_CHUNK_TOKENS - 1]) == []


def test_a_cache_salt_starts_its_own_chain() -> None:
    tokens = family(2, 2 * PREFIX_CHUNK_TOKENS)
    plain = prefix_chunk_hashes(tokens)
    tenant_a = prefix_chunk_hashes(tokens, cache_salt="tenant-a")
    assert len(tenant_a) == len(plain) == 2
    assert not set(tenant_a) & set(plain)  # no affinity across salts: the engine shares no block across them
    assert not set(tenant_a) & set(prefix_chunk_hashes(tokens, cache_salt="tenant-b"))
    assert prefix_chunk_hashes(tokens, cache_salt="tenant-a") == tenant_a
    assert prefix_chunk_hashes(tokens, cache_salt="") == plain  # an empty salt is no salt


def test_index_matches_the_longest_recorded_prefix_on_a_live_replica() -> None:
    index = PrefixAffinityIndex()
    shared = family(2, 4 * PREFIX_CHUNK_TOKENS)
    index.record(prefix_chunk_hashes(shared[: 2 * PREFIX_CHUNK_TOKENS]), "a")
    index.record(prefix_chunk_hashes(shared), "b")  # the longer prefix, on b (its first chunks move to b)
    assert index.match(prefix_chunk_hashes(shared + [1, 2, 3]), {"a", "b"}) == ("b", 4)
    assert index.match(prefix_chunk_hashes(shared), {"a"}) == (None, 0)  # b left
    assert index.match(prefix_chunk_hashes(family(3)), {"a", "b"}) == (None, 0)
    index.forget("b")
    assert len(index) == 0


def test_index_is_bounded_and_keeps_the_leading_chunks() -> None:
    index = PrefixAffinityIndex(capacity=10)
    hashes = prefix_chunk_hashes(family(4, 20 * PREFIX_CHUNK_TOKENS))
    index.record(hashes, "a")
    assert len(index) == 10
    assert index.match(hashes, {"a"}) == ("a", 10)  # the tail went: what is left is still a prefix


def test_index_forgets_what_a_replica_cache_no_longer_holds() -> None:
    index = PrefixAffinityIndex()
    first, second, third = (prefix_chunk_hashes(family(seed, 4 * PREFIX_CHUNK_TOKENS)) for seed in (11, 12, 13))
    for hashes in (first, second, third):
        index.record(hashes, "a", replica_chunks=10)  # a's cache holds 10 chunks
    assert index.match(first, {"a"}) == ("a", 2)  # the oldest prompt lost its last two chunks, tail first
    assert index.match(second, {"a"}) == ("a", 4) and index.match(third, {"a"}) == ("a", 4)
    index.record(third, "b", replica_chunks=10)  # sent elsewhere: a no longer counts it among its chunks
    index.record(prefix_chunk_hashes(family(14, 4 * PREFIX_CHUNK_TOKENS)), "a", replica_chunks=10)
    assert index.match(second, {"a"}) == ("a", 4)  # so a still has room for second
    assert index.match(third, {"a", "b"}) == ("b", 4)
    index.forget("a")
    assert index.match(second, {"a", "b"}) == (None, 0) and len(index) == 4


def test_prefix_affinity_prefers_the_owner_unless_it_is_much_busier() -> None:
    index = PrefixAffinityIndex()
    hashes = prefix_chunk_hashes(family(5))
    index.record(hashes, "b")
    loads = [ReplicaLoad("a", 0), ReplicaLoad("b", 3)]
    ranks, by_prefix = prefix_affinity_ranks(index, hashes, loads, imbalance_threshold=4)
    assert by_prefix and ranks == [["b"], ["a"]]
    busy = [ReplicaLoad("a", 0), ReplicaLoad("b", 5)]
    ranks, by_prefix = prefix_affinity_ranks(index, hashes, busy, imbalance_threshold=4)
    assert not by_prefix and ranks[0] == ["a"]
    full = [ReplicaLoad("a", 0), ReplicaLoad("b", 0, kv_usage=0.99)]
    assert prefix_affinity_ranks(index, hashes, full, imbalance_threshold=4)[0][0] == ["a"]
    unknown, by_prefix = prefix_affinity_ranks(index, prefix_chunk_hashes(family(6)), loads, 4)
    assert not by_prefix and unknown == [["a"], ["b"]]


def test_a_prompt_computed_from_scratch_goes_where_least_prefill_is_queued() -> None:
    loads = [ReplicaLoad("a", 1, prefill_tokens=1000), ReplicaLoad("b", 2, prefill_tokens=0)]
    assert least_loaded_ranks(loads) == [["a"], ["b"]]  # fewest in flight
    ranks, by_prefix = prefix_affinity_ranks(PrefixAffinityIndex(), prefix_chunk_hashes(family(8)), loads, 4)
    assert not by_prefix and ranks == [["b"], ["a"]]  # nothing known: b starts it first
    tied = [ReplicaLoad("a", 3, prefill_tokens=64), ReplicaLoad("b", 1, prefill_tokens=64)]
    assert least_prefill_ranks(tied) == [["b"], ["a"]]
    full = [ReplicaLoad("a", 0, kv_usage=KV_FULL), ReplicaLoad("b", 5, prefill_tokens=900)]
    assert least_prefill_ranks(full) == [["b"], ["a"]]


def test_a_shared_system_prompt_alone_does_not_decide() -> None:
    index = PrefixAffinityIndex()
    system = family(9, 2 * PREFIX_CHUNK_TOKENS)
    index.record(prefix_chunk_hashes(system + family(10)), "a")
    loads = [ReplicaLoad("a", 2), ReplicaLoad("b", 0)]
    other = system + family(15)  # the same 32-token system prompt, another conversation
    ranks, by_prefix = prefix_affinity_ranks(index, prefix_chunk_hashes(other), loads, 8, prompt_tokens=len(other))
    assert not by_prefix and ranks[0] == ["b"]
    again = system + family(10) + [7, 8, 9]  # the first conversation's next turn: most of it is known
    ranks, by_prefix = prefix_affinity_ranks(index, prefix_chunk_hashes(again), loads, 8, prompt_tokens=len(again))
    assert by_prefix and ranks[0] == ["a"]
    ranks, by_prefix = prefix_affinity_ranks(
        index, prefix_chunk_hashes(again), loads, 8, prompt_tokens=len(again), min_match_ratio=0.99
    )
    assert not by_prefix


def test_a_long_prompt_is_matched_on_its_leading_chunks() -> None:
    index = PrefixAffinityIndex()
    document = family(16, MAX_PREFIX_CHUNKS * PREFIX_CHUNK_TOKENS)
    index.record(prefix_chunk_hashes(document), "b")
    question = document + family(17, 6000)  # 10,096 tokens: only the first 4,096 are hashed
    loads = [ReplicaLoad("a", 0), ReplicaLoad("b", 1)]
    ranks, by_prefix = prefix_affinity_ranks(
        index, prefix_chunk_hashes(question), loads, 8, prompt_tokens=len(question)
    )
    assert by_prefix and ranks == [["b"], ["a"]]


def test_router_counters_count_affinity_hits_per_family() -> None:
    counters = RouterCounters()
    params = SamplingParams()

    def request(tokens: list[int]) -> EngineCoreRequest:
        return EngineCoreRequest("r", tokens, params, 0.0)

    counters.record_routed(request(family(7) + [1]), "a", {"a", "b"})  # first of its family: no query
    counters.record_routed(request(family(7) + [2]), "a", {"a", "b"})  # same replica: a hit
    counters.record_routed(request(family(7) + [3]), "b", {"a", "b"})  # another replica: a miss
    assert (counters.prefix_queries, counters.prefix_hits) == (2, 1)
    assert counters.requests == {"a": 2, "b": 1}
    salted = EngineCoreRequest("s", family(7) + [4], params, 0.0, cache_salt="tenant")
    counters.record_routed(salted, "a", {"a", "b"})  # its salt's first: no query, though the tokens match
    assert (counters.prefix_queries, counters.prefix_hits) == (2, 1)


def test_merge_stats_sums_counts_and_weights_kv_usage_by_blocks() -> None:
    first = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_blocks=10, prefix_cache_hits=3)
    second = SchedulerStats(num_running=1, kv_cache_usage=0.0, num_blocks=30, iteration_token_counts=(1, 2))
    third = SchedulerStats(num_blocks=0, iteration_token_counts=(4, 0))
    merged = merge_stats([first, second, third])
    assert (merged.num_running, merged.num_waiting, merged.num_blocks, merged.prefix_cache_hits) == (3, 1, 40, 3)
    assert merged.kv_cache_usage == 5 / 40
    assert merged.iteration_token_counts == (5, 2)
    assert merge_stats([]) == SchedulerStats()
