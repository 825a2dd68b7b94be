"""Buffers on huge pages: the KV cache (same zeros as torch.zeros), packed weights moved there
(same values, one buffer, originals released), and the kernel is really asked."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

from pagedserve.worker.host_memory import HUGE_PAGE_BYTES, advise_huge_pages, move_to_huge_pages, zeros_on_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_zeros_on_huge_pages_is_zeros():
    shape = (2, 300, 16, 3, 64)
    tensor = zeros_on_huge_pages(shape, torch.bfloat16, torch.device("cpu"))
    assert tensor.shape == shape and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    assert torch.equal(tensor, torch.zeros(shape, dtype=torch.bfloat16))


def test_moved_tensors_keep_their_values_in_one_buffer():
    originals = [torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.int64), torch.randn(2, 4, 6).transpose(0, 2)]
    expected = [tensor.clone() for tensor in originals]
    tracked = [weakref.ref(tensor) for tensor in originals]
    copies = move_to_huge_pages(originals)
    assert originals == []  # the list was taken over
    gc.collect()
    assert all(ref() is None for ref in tracked)  # nothing else held them: released
    for copy, want in zip(copies, expected):
        assert copy.shape == want.shape and copy.dtype == want.dtype and copy.is_contiguous()
        assert torch.equal(copy, want)
    storage = copies[0].untyped_storage().data_ptr()
    assert all(copy.untyped_storage().data_ptr() == storage for copy in copies)
    assert all(copy.data_ptr() % 64 == 0 for copy in copies)
    copies[0][0, 0] = 42.0  # views into one buffer, not overlapping
    assert torch.equal(copies[1], expected[1]) and torch.equal(copies[2], expected[2])


def test_small_buffers_are_left_alone():
    assert not advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 8, dtype=torch.uint8))


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
    reason="no transparent huge pages here",
)
def test_large_buffers_get_the_advice():
    assert advise_huge_pages(torch.empty(8 * HUGE_PAGE_BYTES, dtype=torch.uint8))
