"""KVCacheManager: block tables of requests on top of the BlockPool (allocation, prefix hits, copy-on-write, freeing)."""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool, KVBlock, hash_block, salt_hash
from pagedserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the BlockPool and every request's block table (``request.block_ids``).

    Layout of one request after ``allocate_slots(req, num_new_tokens, hits)``::

        | prefix hits | computed | new tokens this step | (rest of last block) |
        |<-- num_computed_tokens -->|<-- num_new_tokens -->|
        |<------------ block_ids cover all of this ------------------------->|
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies before the next forward
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Leading full blocks of a not-yet-computed request found in the prefix cache.

        At most ``num_tokens - 1`` tokens can hit, so the last token is always computed and yields logits.
        """
        if (
            not self.enable_caching
            or request.num_computed_tokens > 0
            or request.sampling_params.prompt_logprobs is not None
        ):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[KVBlock] = []
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(max_blocks):
            block = self.pool.get_cached_block(request.block_hashes[i], tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Give ``request`` room for ``num_new_tokens`` more tokens (after its prefix hits).

        Returns False, changing nothing, when there are not enough free blocks.
        """
        computed_blocks = computed_blocks or []
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(computed_blocks) * bs
        num_held = len(request.block_ids) + len(computed_blocks)
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, bs) - num_held)
        cow_index = self._shared_write_block(request, num_computed) if num_new_tokens else None
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + (cow_index is not None) + num_revived > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(block.block_id for block in computed_blocks)
            request.num_registered_blocks = len(request.block_ids)
        if cow_index is not None:
            self._copy_on_write(request, cow_index)
        if num_new_blocks:
            request.block_ids.extend(block.block_id for block in self.pool.allocate(num_new_blocks))
        return True

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def share_blocks(self, source: Request, target: Request) -> None:
        """Make ``target`` (a fork) reference every block of ``source``."""
        target.block_ids = list(source.block_ids)
        self.pool.touch([self.pool.blocks[i] for i in target.block_ids])

    def cache_blocks(self, request: Request) -> None:
        """Offer the request's newly completed full blocks to the prefix cache."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        self._extend_hashes(request, num_full)
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(request.num_registered_blocks, num_full):
            block = self.pool.blocks[request.block_ids[i]]
            self.pool.cache_block(block, request.block_hashes[i], tokens[i * bs : (i + 1) * bs])
        request.num_registered_blocks = num_full

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (so tails are evicted first)."""
        if request.block_ids:
            self.pool.free([self.pool.blocks[i] for i in reversed(request.block_ids)])
        request.block_ids = []
        request.num_registered_blocks = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _shared_write_block(self, request: Request, num_computed: int) -> int | None:
        """Index of the partially filled block the next token goes into, if another request shares it."""
        if num_computed % self.block_size == 0:
            return None
        index = num_computed // self.block_size
        if index >= len(request.block_ids):
            return None
        return index if self.pool.blocks[request.block_ids[index]].ref_cnt > 1 else None

    def _copy_on_write(self, request: Request, index: int) -> None:
        old = self.pool.blocks[request.block_ids[index]]
        (new,) = self.pool.allocate(1)
        self.pending_copies.append((old.block_id, new.block_id))
        self.pool.free([old])
        request.block_ids[index] = new.block_id

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_hash(request.cache_salt)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
