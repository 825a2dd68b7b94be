"""Large host buffers backed by transparent huge pages (Linux), for the paged KV cache and the
packed linear weights on CPUs.

Decode attention reads cache blocks scattered over gigabytes; with 4 KiB pages nearly every
block costs TLB misses, with 2 MiB pages almost none. A decode step also streams every weight
once, and on 4 KiB pages its matmuls pay the same misses (measurements in
docs/design/cpu-performance.md). Where the kernel keeps THP in ``madvise`` mode (a common
default) memory gets huge pages only when asked, before it is first touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages over the 2 MiB-aligned part of a CPU tensor's memory; True if the kernel agreed."""
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = (start + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def move_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors``, one after another in a single buffer backed by huge
    pages where the kernel allows them (each copy on a 64-byte boundary), in the same order.

    Takes the list over: it is emptied as the copies are made, so an original that nothing else
    holds is freed right after its copy. The buffer's pages are committed as they are written:
    memory grows by about one tensor during the move, not by all of them.
    """
    sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
    arena = torch.empty(sum((size + 63) // 64 * 64 for size in sizes), dtype=torch.uint8)  # no pages mapped yet
    advise_huge_pages(arena)
    copies, offset = [], 0
    for size in sizes:
        tensor = tensors.pop(0)
        copy = arena[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
        offset += (size + 63) // 64 * 64
    return copies


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``; on a Linux CPU, backed by huge pages where the kernel allows them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype, device=device)  # not touched yet: no pages mapped
    advise_huge_pages(tensor)
    return tensor.zero_()


def kv_cache_tensors(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """A paged KV cache: per layer one zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    tensor (K and V), on huge pages where they are allowed."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [zeros_on_huge_pages(shape, dtype, device) for _ in range(num_layers)]
