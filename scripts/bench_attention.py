"""Micro-benchmark of the C++ paged decode attention kernel, one layer call at a time.

Builds a bf16 KV cache on huge pages with SmolLM2-135M's attention shapes (9 query heads, 3 KV
heads, head_dim 64), gives every sequence its own blocks in shuffled order (as a long-running
cache looks), and times ``paged_decode_attention`` over 30 layers' worth of distinct blocks, so
that the reads come from memory as in a real decode step. ``--in-cache`` points every sequence
and layer at the same few blocks instead: the kernel's compute cost without the memory traffic.

    python scripts/bench_attention.py --batch 64 --context 1000
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedserve.kernels import load_cpu_kernels
from pagedserve.worker.host_memory import zeros_on_huge_pages

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--in-cache", action="store_true", help="every sequence reads the same blocks")
    args = parser.parse_args()

    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels could not be built")
    blocks_per_seq = -(-args.context // args.block_size)
    per_layer = blocks_per_seq if args.in_cache else args.batch * blocks_per_seq
    num_blocks = LAYERS * per_layer + 1
    cache = zeros_on_huge_pages(
        (2, num_blocks, args.block_size, KV_HEADS, HEAD_DIM), torch.bfloat16, torch.device("cpu")
    )
    flat = cache.view(-1)
    chunk = torch.randn(1 << 20).bfloat16()
    for start in range(0, flat.numel(), chunk.numel()):
        flat[start : start + chunk.numel()] = chunk[: flat.numel() - start]
    ids = list(range(1, num_blocks))
    random.Random(0).shuffle(ids)
    tables = []
    for layer in range(LAYERS):
        mine = torch.tensor(ids[layer * per_layer : (layer + 1) * per_layer])
        tables.append(mine.repeat(args.batch, 1) if args.in_cache else mine.view(args.batch, blocks_per_seq))
    lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    q = torch.randn(args.batch, HEADS, HEAD_DIM).bfloat16()
    scale = HEAD_DIM**-0.5
    for table in tables:  # warm-up: every layer once
        kernels.paged_decode_attention(q, cache, table, lens, scale)
    start = time.perf_counter()
    for i in range(args.calls):
        kernels.paged_decode_attention(q, cache, tables[i % LAYERS], lens, scale)
    per_call = (time.perf_counter() - start) / args.calls
    kv_bytes = args.batch * args.context * 2 * KV_HEADS * HEAD_DIM * 2
    where = "same blocks (in cache)" if args.in_cache else "distinct blocks per layer"
    print(
        f"batch {args.batch}, context {args.context}, block size {args.block_size}, {where}: "
        f"{per_call * 1e3:.2f} ms per layer call ({per_call * LAYERS * 1e3:.1f} ms per {LAYERS}-layer step), "
        f"{kv_bytes / per_call / 1e9:.1f} GB/s of KV"
    )


if __name__ == "__main__":
    main()
