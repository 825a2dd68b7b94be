"""Paged attention: cache writes, prefill chunks over cached context, decode; the C++ CPU kernel against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.worker.attention import _decode_attention, build_attention_metadata, paged_attention, write_kv
from pagedserve.worker.cpu_kernels import load_cpu_kernels

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
    out = paged_attention(torch.cat([qa[:5], qb[:6]]), torch.cat([ka[:5], kb[:6]]), torch.cat([va[:5], vb[:6]]), cache, meta, DIM**-0.5)
    torch.testing.assert_close(out[:5], causal_reference(qa, ka, va)[:5])
    torch.testing.assert_close(out[5:], causal_reference(qb[:6], kb[:6], vb[:6]))
    # step 2: b decodes one token (first), a prefills its last 3 tokens over its cached 5
    meta = build_attention_metadata([6, 5], [1, 3], [table_b, table_a], BS)
    assert meta.num_decodes == 1
    out = paged_attention(torch.cat([qb[6:], qa[5:]]), torch.cat([kb[6:], ka[5:]]), torch.cat([vb[6:], va[5:]]), cache, meta, DIM**-0.5)
    torch.testing.assert_close(out[1:], causal_reference(qa, ka, va)[5:])
    torch.testing.assert_close(out[0], causal_reference(qb, kb, vb)[6])


# block sizes: 16 and 128 take the AMX score path where the CPU has AMX, 8 the vdpbf16ps one;
# query / KV heads: groups of 3, 8 (values summed in two register batches) and 1
@pytest.mark.parametrize("block_size, heads, kv_heads", [(16, 9, 3), (8, 9, 3), (128, 8, 1), (16, 4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_kernel_matches_reference_decode(dtype, tol, head_dim, block_size, heads, kv_heads):
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernel could not be built on this machine")
    torch.manual_seed(0)
    lens = [1, 2, 5, 15, 16, 17, 31, 33, 100, 250, 301]
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
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernel could not be built on this machine")
    torch.manual_seed(0)
    kv_heads, dim, tokens = 3, 64, 7
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim).to(dtype)  # k and v are strided views into it
    key = qkv[:, 9 * dim:(9 + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = qkv[:, (9 + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.tensor([5, 0, 63, 17, 18, 40, 2])
    expected, cache = torch.zeros(2, 4, 16, kv_heads, dim, dtype=dtype), torch.zeros(2, 4, 16, kv_heads, dim, dtype=dtype)
    write_kv(expected, key, value, slots)
    kernels.write_kv_cache_(cache, key, value, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.write_kv_cache_(cache, key, value, torch.tensor([0, 1, 2, 3, 4, 5, 64]))


def test_cpu_kernel_rejects_a_length_beyond_the_block_table():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernel could not be built on this machine")
    cache = torch.zeros(2, 8, 16, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        kernels.paged_decode_attention(q, cache, torch.tensor([[1, 2]]), torch.tensor([33]), 0.125)
    with pytest.raises(RuntimeError, match="one block table row"):
        kernels.paged_decode_attention(q, cache, torch.tensor([[1, 2]]), torch.tensor([3, 4]), 0.125)
