"""Unit tests for the block pool and KV cache manager: hash chaining, ref counts, LRU eviction, copy-on-write."""

from __future__ import annotations

import pytest

from pagedserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int], **params) -> Request:
    return Request(request_id, 0, tokens, SamplingParams(**params), 0.0, (0,))


def test_hash_chain_depends_on_every_earlier_token():
    a = hash_block(None, [1, 2, 3, 4])
    b = hash_block(None, [1, 2, 3, 5])
    assert a != b
    assert hash_block(a, [9, 9, 9, 9]) != hash_block(b, [9, 9, 9, 9])
    assert hash_block(a, [9, 9, 9, 9]) == hash_block(hash_block(None, [1, 2, 3, 4]), [9, 9, 9, 9])


def test_free_queue_order_and_removal():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 2]
    assert queue.num_blocks == 4


def test_pool_ref_counts_and_null_block():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5  # block 0 is the null block
    blocks = pool.allocate(3)
    assert 0 not in [b.block_id for b in blocks]
    assert all(b.ref_cnt == 1 for b in blocks)
    pool.touch(blocks[:1])
    assert blocks[0].ref_cnt == 2
    pool.free(blocks)
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 4
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 5
    with pytest.raises(ValueError):
        pool.allocate(6)


def test_lru_eviction_order_keeps_recently_freed_cached_blocks():
    pool = BlockPool(5)  # 4 usable
    a, b, c, d = pool.allocate(4)
    for i, block in enumerate((a, b, c, d)):
        pool.cache_block(block, 100 + i, [i] * BS)
    pool.free([b, a])  # b freed first -> evicted first
    pool.free([d, c])
    (first,) = pool.allocate(1)
    assert first is b and b.block_hash is None and 101 not in pool.cached
    assert pool.get_cached_block(100, [0] * BS) is a  # still revivable
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    (second,) = pool.allocate(1)
    assert second is d  # a was revived, so d is the next least recently freed


def test_cached_block_collision_is_rejected():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache_block(block, 7, [1, 2, 3, 4])
    assert pool.get_cached_block(7, [1, 2, 3, 4]) is block
    assert pool.get_cached_block(7, [1, 2, 3, 5]) is None


def test_prefix_hit_shares_full_blocks_and_never_the_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    first = make_request("a", prompt)
    assert kv.get_computed_blocks(first) == []
    assert kv.allocate_slots(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.cache_blocks(first)
    second = make_request("b", prompt)
    hits = kv.get_computed_blocks(second)
    assert [h.block_id for h in hits] == first.block_ids[:2]
    exact = make_request("c", prompt[:8])  # 8 tokens = 2 full blocks, but the last token must be recomputed
    assert len(kv.get_computed_blocks(exact)) == 1
    assert kv.allocate_slots(second, len(prompt) - 8, hits)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert kv.pool.blocks[first.block_ids[0]].ref_cnt == 2
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_divergent_prompts_share_only_the_common_prefix():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_blocks(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert len(kv.get_computed_blocks(b)) == 1


def test_copy_on_write_of_a_shared_last_block():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    parent = make_request("a", [1, 2, 3, 4, 5, 6])  # last block half full
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    kv.share_blocks(parent, child)
    shared_last = parent.block_ids[1]
    assert kv.pool.blocks[shared_last].ref_cnt == 2
    parent.append_token(7)
    child.append_token(8)
    assert kv.allocate_slots(child, 1)
    assert child.block_ids[0] == parent.block_ids[0]  # full block still shared
    assert child.block_ids[1] != shared_last  # copied before writing
    assert kv.take_pending_copies() == [(shared_last, child.block_ids[1])]
    assert kv.allocate_slots(parent, 1)  # now the only owner: writes in place
    assert parent.block_ids[1] == shared_last and kv.take_pending_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_allocate_fails_without_side_effects_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks = 12 tokens
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    b = make_request("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == [] and kv.num_free_blocks == 0


def test_cached_free_count_follows_free_revive_evict_and_reset():
    pool = BlockPool(6)
    held = pool.allocate(3)
    pool.cache_block(held[0], hash_block(None, [1, 2, 3, 4]), [1, 2, 3, 4])
    pool.cache_block(held[1], hash_block(None, [5, 6, 7, 8]), [5, 6, 7, 8])
    assert pool.num_cached_free_blocks == 0  # cached but still held
    pool.free(held)
    assert (pool.num_free_blocks, pool.num_cached_free_blocks) == (5, 2)
    pool.touch([held[0]])  # a prefix hit revives one
    assert (pool.num_free_blocks, pool.num_cached_free_blocks) == (4, 1)
    pool.allocate(4)  # the rest, so the other cached block is evicted
    assert (pool.num_free_blocks, pool.num_cached_free_blocks) == (0, 0)
    pool.free([held[0]])
    assert pool.num_cached_free_blocks == 1
    pool.reset_prefix_cache()
    assert pool.num_cached_free_blocks == 0
    assert sum(b.block_hash is not None for b in pool.blocks if b.ref_cnt == 0) == 0
