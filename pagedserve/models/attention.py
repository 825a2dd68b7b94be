"""Paged attention: the per-forward metadata, writing new K/V into cache blocks, and reading them back.

The KV cache of one layer is one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). A request's tokens live in the blocks its block table lists,
token ``t`` at slot ``block_table[t // block_size] * block_size + t % block_size``.

The reference backend here is plain PyTorch (SDPA) and runs on any device; on CPUs the model runner
hands in the C++ kernels (``pagedserve/kernels/csrc/``): decode attention, cache writes and, with AMX, prefill attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Flat variable-length batch layout for one forward pass.

    Requests are laid out one after another along the token dimension, the ``num_decodes``
    single-token (decode) requests first, then the prefill chunks. Request ``i`` owns query
    tokens ``query_start_loc[i]:query_start_loc[i + 1]``; those are the last tokens of its
    context, whose total length after this step is ``seq_lens[i]``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [num_reqs] int64: context length including the new tokens
    query_start_loc: list[int]  # num_reqs + 1 host ints
    seq_lens_host: list[int]  # same as seq_lens, on the host
    num_decodes: int  # the first num_decodes requests have exactly one query token
    block_size: int
    # [num_reqs - num_decodes + 1] int64: query_start_loc of the prefill requests, from 0 (None in a
    # pure decode step)
    prefill_query_start_loc: torch.Tensor | None
    # the compiled CPU kernels (paged_decode_attention, paged_prefill_attention, write_kv_cache_)
    # chosen by the model runner, or None for the PyTorch reference
    kernels: ModuleType | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)


def build_attention_metadata(
    num_computed: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    kernels: ModuleType | None = None,
) -> AttentionMetadata:
    """Metadata for requests that already hold ``num_computed[i]`` tokens and add ``num_new[i]``.

    Requests must be ordered decodes (``num_new == 1`` and ``num_computed > 0``) first.
    """
    num_decodes = 0
    for computed, new in zip(num_computed, num_new):
        if new == 1 and computed > 0:
            num_decodes += 1
        else:
            break
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    for computed, new, table in zip(num_computed, num_new, block_tables):
        for pos in range(computed, computed + new):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(computed + new)
    max_blocks = max((len(t) for t in block_tables), default=1) or 1
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(padded), max_blocks),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc,
        seq_lens_host=seq_lens,
        num_decodes=num_decodes,
        block_size=block_size,
        prefill_query_start_loc=(
            torch.tensor([loc - query_start_loc[num_decodes] for loc in query_start_loc[num_decodes:]], device=device)
            if num_decodes < len(seq_lens)
            else None
        ),
        kernels=kernels,
    )


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at their cache slots."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write the new K/V to the cache, then attend each query token to its request's context."""
    kernels = meta.kernels
    if kernels is not None and key.dtype == kv_cache.dtype:
        kernels.write_kv_cache_(kv_cache, key, value, meta.slot_mapping)
    else:
        write_kv(kv_cache, key, value, meta.slot_mapping)
    if kernels is not None and meta.num_decodes == meta.num_reqs:  # a pure decode step: one kernel call
        return kernels.paged_decode_attention(query, kv_cache, meta.block_tables, meta.seq_lens, scale)
    num = meta.num_decodes
    prefill_kernel = _prefill_kernel_applies(kernels, query, kv_cache)
    if prefill_kernel and num == 0:  # a pure prefill step: one kernel call
        return kernels.paged_prefill_attention(
            query, kv_cache, meta.block_tables, meta.seq_lens, meta.prefill_query_start_loc, scale
        )
    out = torch.empty_like(query)
    if num:
        if kernels is not None:
            out[:num] = kernels.paged_decode_attention(
                query[:num], kv_cache, meta.block_tables[:num], meta.seq_lens[:num], scale
            )
        else:
            out[:num] = _decode_attention(query[:num], kv_cache, meta, scale)
    if prefill_kernel:
        out[num:] = kernels.paged_prefill_attention(
            query[num:], kv_cache, meta.block_tables[num:], meta.seq_lens[num:], meta.prefill_query_start_loc, scale
        )
        return out
    for i in range(meta.num_decodes, meta.num_reqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens_host[i]
        if end - start == seq_len:  # the whole context is new: attend to the fresh K/V directly
            k, v = key[start:end], value[start:end]
        else:
            k, v = _gather_context(kv_cache, meta.block_tables[i], seq_len)
        out[start:end] = _prefill_attention(query[start:end], k, v, scale)
    return out


def _prefill_kernel_applies(kernels: ModuleType | None, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C++ prefill kernel takes this layer's prompt chunks (bf16, head_dim 64 / 128,
    blocks of a multiple of 16 tokens, a CPU with AVX512-BF16; AMX tiles where granted); otherwise
    PyTorch's SDPA does, per request."""
    return (
        kernels is not None
        and query.dtype == kv_cache.dtype == torch.bfloat16
        and query.shape[-1] in (64, 128)
        and kv_cache.shape[2] % 16 == 0
        and kernels.has_prefill_attention()
    )


def _gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[seq_len, num_kv_heads, head_dim]`` of one request, read through its block table."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[:num_blocks]]  # [2, n, block_size, kv_heads, head_dim]
    blocks = blocks.flatten(1, 2)[:, :seq_len]  # [2, seq_len, kv_heads, head_dim]
    return blocks[0], blocks[1]


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions of a context over all ``len(k)`` of it."""
    num_q, num_k = q.shape[0], k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, num_q, head_dim]
    kh = k.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, kv_heads, num_k, head_dim]
    vh = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    enable_gqa = qh.shape[1] != kh.shape[1]
    if num_q == num_k:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    else:
        q_pos = torch.arange(num_k - num_q, num_k, device=q.device)
        mask = torch.arange(num_k, device=q.device)[None, :] <= q_pos[:, None]  # [num_q, num_k]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return o.squeeze(0).transpose(0, 1)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query token per request over its whole context, all decode requests at once."""
    num = q.shape[0]
    block_size = kv_cache.shape[2]
    max_len = max(meta.seq_lens_host[:num])
    num_blocks = (max_len + block_size - 1) // block_size
    tables = meta.block_tables[:num, :num_blocks]  # [num, num_blocks]
    kv = kv_cache[:, tables]  # [2, num, num_blocks, block_size, kv_heads, head_dim]
    kv = kv.flatten(2, 3)[:, :, :max_len]  # [2, num, max_len, kv_heads, head_dim]
    k = kv[0].transpose(1, 2).to(q.dtype)  # [num, kv_heads, max_len, head_dim]
    v = kv[1].transpose(1, 2).to(q.dtype)
    mask = torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:num, None]  # [num, max_len]
    qh = q.unsqueeze(2)  # [num, heads, 1, head_dim]
    o = F.scaled_dot_product_attention(
        qh, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=qh.shape[1] != k.shape[1]
    )
    return o.squeeze(2)  # [num, heads, head_dim]
