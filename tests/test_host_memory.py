"""KV cache buffers on huge pages: same zeros as torch.zeros, and the kernel is really asked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedserve.worker.host_memory import HUGE_PAGE_BYTES, advise_huge_pages, zeros_on_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_zeros_on_huge_pages_is_zeros():
    shape = (2, 300, 16, 3, 64)
    tensor = zeros_on_huge_pages(shape, torch.bfloat16, torch.device("cpu"))
    assert tensor.shape == shape and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    assert torch.equal(tensor, torch.zeros(shape, dtype=torch.bfloat16))


def test_small_buffers_are_left_alone():
    assert not advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 8, dtype=torch.uint8))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP_MODE.exists()
                    or "[never]" in THP_MODE.read_text(), reason="no transparent huge pages here")
def test_large_buffers_get_the_advice():
    assert advise_huge_pages(torch.empty(8 * HUGE_PAGE_BYTES, dtype=torch.uint8))
