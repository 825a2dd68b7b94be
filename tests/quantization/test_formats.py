"""Quantized weight formats without a model: the GGUF block decoders against the gguf package's own
dequantization, the load-time int8 / int4 quantizers' error bounds, regrouping and fused-shard
concatenation, and the packed layout's embedding lookup."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedserve.models.gguf_quants import GGUF_KEPT_TYPES, decode_gguf_tensor
from pagedserve.models.quantization import (
    GroupQuantized,
    QuantizationConfig,
    can_pack_for_cpu,
    quantize_int4,
    quantize_int8,
)

# where each type keeps its float16 scale fields (byte offsets in a block)
SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random raw bytes of a ``rows x cols`` tensor of ``type_name``, with finite float16 scales."""
    rng = np.random.default_rng(seed)
    block_values, block_bytes = GGUF_KEPT_TYPES[type_name]
    raw = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[type_name]:
        scales = (rng.random((rows, cols // block_values)) * 0.02 - 0.005).astype(np.float16)
        raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // block_values, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(GGUF_KEPT_TYPES))
@pytest.mark.parametrize("rows, cols", [(16, 256), (3, 512), (48, 768)])
def test_gguf_blocks_decode_to_the_gguf_packages_values_exactly(type_name, rows, cols):
    raw = random_blocks(type_name, rows, cols, seed=rows + cols)
    expected = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    decoded = decode_gguf_tensor(raw, type_name, (rows, cols))
    assert decoded.shape == (rows, cols) and decoded.values.dtype == torch.int8
    np.testing.assert_array_equal(decoded.dequantize().numpy(), expected)


def test_q8_0_written_by_the_gguf_package_reads_back():
    weight = np.random.default_rng(1).standard_normal((32, 96)).astype(np.float32)
    raw = quantize(weight, GGMLQuantizationType.Q8_0)
    decoded = decode_gguf_tensor(raw, "Q8_0", (32, 96))
    np.testing.assert_array_equal(decoded.dequantize().numpy(), dequantize(raw, GGMLQuantizationType.Q8_0))
    assert np.abs(decoded.dequantize().numpy() - weight).max() <= np.abs(weight).max() / 127


def test_unsupported_gguf_type_and_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="not kept quantized"):
        decode_gguf_tensor(np.zeros((2, 36), np.uint8), "Q5_0", (2, 64))
    with pytest.raises(ValueError, match="whole number"):
        decode_gguf_tensor(np.zeros((2, 36), np.uint8), "Q8_0", (2, 48))


def test_int8_is_within_half_a_step_per_row():
    weight = torch.randn(64, 200) * torch.linspace(0.01, 3, 64)[:, None]
    q = quantize_int8(weight)
    assert q.values.dtype == torch.int8 and q.scales.shape == (64, 1) and q.zeros is None
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - weight).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_is_within_half_a_step_per_group(symmetric, group_size):
    weight = torch.randn(32, 256) + torch.randn(32, 1)  # offsets per row: zero-points help
    q = quantize_int4(weight, group_size, symmetric)
    assert q.scales.shape == (32, 256 // group_size) and (q.zeros is None) == symmetric
    low, high = (-8, 7) if symmetric else (0, 15)
    assert low <= int(q.values.min()) and int(q.values.max()) <= high
    err = (q.dequantize() - weight).abs().view(32, -1, group_size).amax(dim=-1)
    assert (err <= q.scales / 2 + 1e-5).all()
    if not symmetric:
        relative = (q.dequantize() - weight).norm() / weight.norm()
        assert relative < 0.1


def test_int4_refuses_a_width_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(torch.randn(16, 48), 32, False)


def test_regroup_and_row_concatenation_keep_the_weight():
    a = quantize_int4(torch.randn(16, 64), 32, False)
    b = decode_gguf_tensor(random_blocks("Q6_K", 8, 256, seed=3), "Q6_K", (8, 256))  # groups of 16, no zeros
    c = quantize_int4(torch.randn(8, 256), 32, False)  # with zero-points: b gets zeros of 0
    joined = GroupQuantized.cat_rows([b, c])
    assert joined.group_size == 16 and joined.zeros is not None and joined.shape == (16, 256)
    torch.testing.assert_close(joined.dequantize(), torch.cat([b.dequantize(), c.dequantize()]))
    torch.testing.assert_close(a.regroup(16).dequantize(), a.dequantize())
    with pytest.raises(ValueError):
        b.regroup(32)


def test_lookup_reads_rows_of_the_dequantized_weight():
    q = quantize_int4(torch.randn(40, 64), 32, False)
    ids = torch.tensor([[0, 39], [7, 7]])
    rows = q.lookup(ids, torch.float32)
    assert rows.shape == (2, 2, 64)
    torch.testing.assert_close(rows, q.dequantize()[ids])


def test_config_validation_and_pack_eligibility():
    with pytest.raises(ValueError, match="quantization must be"):
        QuantizationConfig("int3")
    with pytest.raises(ValueError, match="group size"):
        QuantizationConfig("int4", group_size=48)
    assert can_pack_for_cpu(quantize_int8(torch.randn(32, 10)))
    assert not can_pack_for_cpu(quantize_int8(torch.randn(32, 9)))  # the kernel reads inputs in pairs
    assert not can_pack_for_cpu(quantize_int8(torch.randn(24, 10)))  # rows not a multiple of 16
