"""Paged attention: cache writes, prefill chunks over cached context, decode; the C++ CPU kernel against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.models.attention import (
    _decode_attention,
    _gather_context,
    _prefill_attention,
    build_attention_metadata,
    paged_attention,
    write_kv,
)
from tests.utils import cpu_kernels_or_skip

HEADS, KV_HEADS, DIM, BS = 4, 2, 8, 4


def causal_reference(q, k, v):
    # q [n, heads, dim], k/v [n, kv_heads, dim]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def test_chunked_prefill_and_decode_through_block_tables_match_dense_attention():
    torch.manual_seed(0)
    cache = torch.zeros(2, 20, BS, KV_HEADS, DIM)
    qa, ka, va = torch.randn(8, HEADS, DIM), torch.randn(8, KV_HEADS, DIM), torch.randn(8, KV_HEADS, DIM)
    qb, kb, vb = torch.randn(7, HEADS, DIM), torch.randn(7, KV_HEADS, DIM), torch.randn(7, KV_HEADS, DIM)
    table_a, table_b = [3, 5], [1, 7]  # scattered, non-contiguous blocks
    # step 1: the first 5 tokens of a, the first 6 of b
    meta = build_attention_metadata([0, 0], [5, 6], [table_a, table_b], BS)
    out = paged_attention(
        torch.cat([qa[:5], qb[:6]]), torch.cat([ka[:5], kb[:6]]), torch.cat([va[:5], vb[:6]]), cache, meta, DIM**-0.5
    )
    torch.testing.assert_close(out[:5], causal_reference(qa, ka, va)[:5])
    torch.testing.assert_close(out[5:], causal_reference(qb[:6], kb[:6], vb[:6]))
    # step 2: b decodes one token (first), a prefills its last 3 tokens over its cached 5
    meta = build_attention_metadata([6, 5], [1, 3], [table_b, table_a], BS)
    assert meta.num_decodes == 1
    out = paged_attention(
        torch.cat([qb[6:], qa[5:]]), torch.cat([kb[6:], ka[5:]]), torch.cat([vb[6:], va[5:]]), cache, meta, DIM**-0.5
    )
    torch.testing.assert_close(out[1:], causal_reference(qa, ka, va)[5:])
    torch.testing.assert_close(out[0], causal_reference(qb, kb, vb)[6])


# block sizes: 16 and 128 take the AMX score path where the CPU has AMX, 8 the vdpbf16ps one;
# contexts of 128 tokens and more also sum their values with AMX there (head_dim 64);
# query / KV heads: groups of 3, 8 (values summed in two register batches) and 1
@pytest.mark.parametrize("block_size, heads, kv_heads", [(16, 9, 3), (8, 9, 3), (128, 8, 1), (16, 4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_kernel_matches_reference_decode(dtype, tol, head_dim, block_size, heads, kv_heads):
    kernels = cpu_kernels_or_skip()
    torch.manual_seed(0)
    lens = [1, 2, 5, 15, 16, 17, 31, 33, 100, 127, 128, 129, 250, 301, 543]
    num_blocks = 1 + sum((n + block_size - 1) // block_size for n in lens)
    # NaN everywhere no context token lives: a kernel that reads past a sequence's length poisons its output
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    tables, next_block = [], 1
    for length in lens:
        n = (length + block_size - 1) // block_size
        table = list(range(next_block + n - 1, next_block - 1, -1))  # reversed: order must come from the table
        tables.append(table)
        next_block += n
        for t in range(length):
            cache[:, table[t // block_size], t % block_size] = torch.randn(2, kv_heads, head_dim).to(dtype)
    meta = build_attention_metadata([n - 1 for n in lens], [1] * len(lens), tables, block_size)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    reference = _decode_attention(q.float(), torch.nan_to_num(cache.float(), nan=0.0), meta, head_dim**-0.5)
    out = kernels.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, head_dim**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_write_matches_reference_on_qkv_views(dtype):
    kernels = cpu_kernels_or_skip()
    torch.manual_seed(0)
    kv_heads, dim, tokens = 3, 64, 7
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim).to(dtype)  # k and v are strided views into it
    key = qkv[:, 9 * dim : (9 + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = qkv[:, (9 + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.tensor([5, 0, 63, 17, 18, 40, 2])
    expected, cache = (
        torch.zeros(2, 4, 16, kv_heads, dim, dtype=dtype),
        torch.zeros(2, 4, 16, kv_heads, dim, dtype=dtype),
    )
    write_kv(expected, key, value, slots)
    kernels.write_kv_cache_(cache, key, value, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.write_kv_cache_(cache, key, value, torch.tensor([0, 1, 2, 3, 4, 5, 64]))


def test_cpu_kernel_rejects_a_length_beyond_the_block_table():
    kernels = cpu_kernels_or_skip()
    cache = torch.zeros(2, 8, 16, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        kernels.paged_decode_attention(q, cache, torch.tensor([[1, 2]]), torch.tensor([33]), 0.125)
    with pytest.raises(RuntimeError, match="one block table row"):
        kernels.paged_decode_attention(q, cache, torch.tensor([[1, 2]]), torch.tensor([3, 4]), 0.125)


def prefill_kernels():
    return cpu_kernels_or_skip("has_prefill_attention", "no AVX512-BF16 on this machine (or no compiler)")


def prefill_back_ends(kernels) -> list[bool]:
    """allow_amx values to test: the AVX512-BF16 back end always, the AMX one where this machine has it."""
    return [False, True] if kernels.has_amx_prefill_attention() else [False]


def nan_filled_cache(lens, block_size, kv_heads, head_dim):
    """A bf16 cache holding random K/V for each context (blocks in reversed order), NaN everywhere else."""
    num_blocks = 1 + sum((n + block_size - 1) // block_size for n in lens)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    tables, next_block = [], 1
    for length in lens:
        n = (length + block_size - 1) // block_size
        table = list(range(next_block + n - 1, next_block - 1, -1))
        tables.append(table)
        next_block += n
        for t in range(length):
            cache[:, table[t // block_size], t % block_size] = torch.randn(2, kv_heads, head_dim).to(torch.bfloat16)
    return cache, tables


# prompts from 1 token to several 16-query blocks, whole or as the last chunk over a cached prefix
@pytest.mark.parametrize("block_size, heads, kv_heads", [(16, 9, 3), (128, 8, 1), (32, 4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_matches_reference(head_dim, block_size, heads, kv_heads):
    kernels = prefill_kernels()
    torch.manual_seed(head_dim + block_size)
    lens = [1, 17, 40, 16, 100, 300, 33]
    num_new = [1, 17, 7, 16, 100, 45, 32]  # 7 / 45 / 32 new tokens after a cached prefix
    cache, tables = nan_filled_cache(lens, block_size, kv_heads, head_dim)
    meta = build_attention_metadata([n - k for n, k in zip(lens, num_new)], num_new, tables, block_size)
    q = torch.randn(sum(num_new), heads, head_dim).to(torch.bfloat16)
    scale = head_dim**-0.5
    clean = torch.nan_to_num(cache.float(), nan=0.0)
    for allow_amx in prefill_back_ends(kernels):
        out = kernels.paged_prefill_attention(
            q, cache, meta.block_tables, meta.seq_lens, meta.prefill_query_start_loc, scale, allow_amx=allow_amx
        )
        assert out.dtype == torch.bfloat16 and out.shape == q.shape and not out.isnan().any()
        for i, (length, new) in enumerate(zip(lens, num_new)):
            start = meta.query_start_loc[i]
            k, v = _gather_context(clean, meta.block_tables[i], length)
            expected = _prefill_attention(q[start : start + new].float(), k, v, scale)
            torch.testing.assert_close(out[start : start + new].float(), expected, atol=2e-2, rtol=2e-2)


def test_mixed_step_with_the_prefill_kernel_matches_the_pytorch_path():
    """paged_attention hands decodes to the decode kernel and the prompt chunks after them to the
    prefill kernel; the result is the pure-PyTorch one up to bf16 rounding."""
    kernels = prefill_kernels()
    torch.manual_seed(3)
    block_size, heads, kv_heads, head_dim = 16, 9, 3, 64
    lens, num_new = [50, 9, 64, 130], [1, 1, 64, 30]  # two decodes, a whole prompt, a chunk over a prefix
    cache, tables = nan_filled_cache(lens, block_size, kv_heads, head_dim)
    cache = torch.nan_to_num(cache, nan=0.0)
    total = sum(num_new)
    q = torch.randn(total, heads, head_dim).to(torch.bfloat16)
    k, v = torch.randn(2, total, kv_heads, head_dim).to(torch.bfloat16)
    computed = [length - new for length, new in zip(lens, num_new)]
    reference = paged_attention(
        q, k, v, cache.clone(), build_attention_metadata(computed, num_new, tables, block_size), 0.125
    )
    meta = build_attention_metadata(computed, num_new, tables, block_size, kernels=kernels)
    assert meta.num_decodes == 2
    out = paged_attention(q, k, v, cache.clone(), meta, 0.125)
    torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)
    pure_prefill = build_attention_metadata([0], [64], [tables[2]], block_size, kernels=kernels)
    alone = paged_attention(q[2:66], k[2:66], v[2:66], cache.clone(), pure_prefill, 0.125)
    torch.testing.assert_close(alone.float(), reference[2:66].float(), atol=2e-2, rtol=2e-2)


def test_prefill_kernel_rejects_bad_shapes():
    kernels = prefill_kernels()
    cache = torch.zeros(2, 8, 16, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(4, 9, 64, dtype=torch.bfloat16)
    table, starts = torch.tensor([[1, 2]]), torch.tensor([0, 4])
    with pytest.raises(RuntimeError, match="longer than its block table"):
        kernels.paged_prefill_attention(q, cache, table, torch.tensor([40]), starts, 0.125)
    with pytest.raises(RuntimeError, match="1 .. seq_len queries"):
        kernels.paged_prefill_attention(q, cache, table, torch.tensor([3]), starts, 0.125)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        kernels.paged_prefill_attention(q, cache, table, torch.tensor([8]), torch.tensor([0, 3]), 0.125)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.paged_prefill_attention(
            q, torch.zeros(2, 8, 8, 3, 64, dtype=torch.bfloat16), table, torch.tensor([8]), starts, 0.125
        )
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.paged_prefill_attention(q.float(), cache, table, torch.tensor([8]), starts, 0.125)
