"""The AVX512-BF16 matmul (CPUs without AMX) against F.linear, its packing rules and bad input, the
Linear layer that uses it in place of oneDNN (the tiny models' logits with it: test_models_tiny.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.models.layers import Linear
from pagedserve.worker.cpu_fast_paths import can_pack_linear_weights
from tests.utils import assert_bf16_close, cpu_kernels_or_skip

BF16 = torch.bfloat16


# the kernels fixture (conftest.py) skips this module without it
REQUIRED_KERNEL = ("has_avx512_bf16_linear", "the C++ kernels were not built with AVX512-BF16 here (or no compiler)")


def assert_one_rounding_apart(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert_bf16_close(out, ref, atol=1e-5, max_mismatch=0.02)


# rows: 1-8 take one 16-column slice at a time, more take 8-row x 3-slice blocks with short remainders
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 23, 64, 100, 300])
@pytest.mark.parametrize(
    "out_features, in_features, bias",
    [(16, 2, False), (32, 34, True), (80, 64, False), (960, 576, False), (576, 1536, True)],
)
def test_matches_f_linear(kernels, rows, out_features, in_features, bias):
    torch.manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features) / in_features**0.5).to(BF16)
    b = torch.randn(out_features).to(BF16) if bias else None
    x = torch.randn(rows, in_features).to(BF16)
    out = kernels.linear_avx512_bf16(x, kernels.pack_linear_weight_vnni(weight), b)
    assert out.shape == (rows, out_features) and out.dtype == BF16
    assert_one_rounding_apart(out, F.linear(x, weight, b))


def test_packed_layout_interleaves_pairs_of_inputs_per_column():
    kernels = cpu_kernels_or_skip(reason="no compiler")
    weight = torch.arange(32 * 6, dtype=torch.float32).view(32, 6).to(BF16)
    packed = kernels.pack_linear_weight_vnni(weight)
    assert packed.shape == (2, 3, 16, 2)
    for n, p, c, j in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 2, 15, 1), (1, 1, 3, 0)]:
        assert packed[n, p, c, j] == weight[16 * n + c, 2 * p + j]


def test_strided_batched_and_empty_input(kernels):
    weight = torch.randn(32, 64).to(BF16)
    packed = kernels.pack_linear_weight_vnni(weight)
    wide = torch.randn(5, 128).to(BF16)
    x = wide[:, 32:96]  # rows 128 elements apart
    assert_one_rounding_apart(kernels.linear_avx512_bf16(x, packed, None), F.linear(x, weight))
    batched = torch.randn(2, 3, 64).to(BF16)
    out = kernels.linear_avx512_bf16(batched, packed, None)
    assert out.shape == (2, 3, 32)
    assert_one_rounding_apart(out, F.linear(batched, weight))
    assert kernels.linear_avx512_bf16(torch.empty(0, 64, dtype=BF16), packed, None).shape == (0, 32)


def test_bad_shapes_are_refused(kernels):
    with pytest.raises(RuntimeError, match="% 16"):
        kernels.pack_linear_weight_vnni(torch.randn(24, 64).to(BF16))
    with pytest.raises(RuntimeError, match="even"):
        kernels.pack_linear_weight_vnni(torch.randn(32, 47).to(BF16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.pack_linear_weight_vnni(torch.randn(32, 64))
    packed = kernels.pack_linear_weight_vnni(torch.randn(32, 64).to(BF16))
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear_avx512_bf16(torch.randn(2, 32).to(BF16), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.linear_avx512_bf16(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear_avx512_bf16(torch.randn(2, 64).to(BF16), packed, torch.zeros(31, dtype=BF16))
    with pytest.raises(RuntimeError, match="pack_linear_weight_vnni"):
        kernels.linear_avx512_bf16(torch.randn(2, 64).to(BF16), torch.zeros(2, 32, 16, 4, dtype=BF16), None)


def test_linear_layer_keeps_only_the_avx512_copy(kernels):
    torch.manual_seed(0)
    layer = Linear(576, 960, bias=True, dtype=BF16)
    layer.weight.data.copy_(torch.randn(960, 576) / 24)
    layer.bias.data.copy_(torch.randn(960))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack_weight(batch_size_hint=64, release_original=True, vnni_kernels=kernels)
    assert layer.vnni_weight is not None and layer.packed_weight is None and layer.is_packed
    assert layer.weight.numel() == 0 and "avx512-bf16" in repr(layer)
    for rows in (1, 64, 2048):
        x = torch.randn(rows, 576).to(BF16)
        assert torch.equal(layer(x), kernels.linear_avx512_bf16(x, layer.vnni_weight, layer.bias))
        assert_one_rounding_apart(layer(x), F.linear(x, weight, bias))
    with pytest.raises(RuntimeError, match="pack_weight"):
        layer.weight_loader(layer.bias, bias)


def test_shapes_and_dtypes_the_kernel_cannot_take_stay_on_onednn(kernels):
    if not can_pack_linear_weights(torch.device("cpu"), BF16):
        pytest.skip("this CPU's oneDNN has no native bf16")
    layer = Linear(48, 40, dtype=BF16)  # 40 % 16 != 0
    layer.weight.data.copy_(torch.randn(40, 48))
    weight = layer.weight.detach().clone()
    layer.pack_weight(batch_size_hint=8, release_original=False, vnni_kernels=kernels)
    assert layer.vnni_weight is None and layer.packed_weight is not None
    x = torch.randn(3, 48).to(BF16)
    assert torch.equal(layer(x), F.linear(x, weight))
    fp32 = Linear(64, 32, dtype=torch.float32)
    fp32.weight.data.copy_(torch.randn(32, 64))
    fp32.pack_weight(batch_size_hint=8, release_original=False, vnni_kernels=kernels)
    assert fp32.vnni_weight is None and fp32.packed_weight is not None
