"""BlockPool: the KV cache blocks, their ref counts, the LRU free queue and the prefix-cache map.

A block with ``ref_cnt == 0`` sits in the free queue; if it still carries a hash it can be
revived by a prefix-cache hit until ``allocate`` hands it out again (lazy eviction, least
recently freed first). Block 0 is a null block that is never handed out (padding in block tables).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of ``block_size`` token slots in every layer's cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens, to rule out hash collisions
    prev: KVBlock | None = None  # free-queue links
    next: KVBlock | None = None


def salt_hash(cache_salt: str | None) -> int | None:
    """The parent of a request's first block hash: None without a salt, else a value only requests with
    the same salt share, so that no block is ever a prefix hit across salts."""
    return None if cache_salt is None else hash(("cache_salt", cache_salt))


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chain hash of a full block: depends on every token before it through ``parent_hash``."""
    return hash((parent_hash, tuple(token_ids)))


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks: pop from the head, append at the tail, O(1) removal."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_blocks += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, "block is not in the free queue"
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_blocks -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is None or block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        ids = []
        block = self._head.next
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next
        return ids


class BlockPool:
    """All KV blocks. Invariant: a block is in the free queue iff its ``ref_cnt`` is 0 (block 0 excepted)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int, KVBlock] = {}
        self.num_cached_free_blocks = 0  # free blocks that still carry a hash (a prefix hit can revive them)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by live requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def allocate(self, num: int) -> list[KVBlock]:
        if num > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.num_cached_free_blocks -= 1
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block; pass tails first so they are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1

    def cache_block(self, block: KVBlock, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its chain hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        self.num_cached_free_blocks = 0
