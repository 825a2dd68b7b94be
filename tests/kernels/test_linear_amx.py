"""The AMX bf16 matmul of small steps against F.linear, its packing rules and bad input, and the
Linear layer's choice between it and oneDNN by row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.models.layers import AMX_LINEAR_MAX_ROWS, Linear
from pagedserve.worker.cpu_fast_paths import can_pack_linear_weights
from tests.utils import assert_bf16_close

BF16 = torch.bfloat16


# the kernels fixture (conftest.py) skips this module without it
REQUIRED_KERNEL = ("has_amx_linear", "no AMX bf16 tiles on this machine (or no compiler)")


def assert_one_rounding_apart(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert_bf16_close(out, ref, atol=1e-5, max_mismatch=0.02)


@pytest.mark.parametrize("rows", [1, 7, 16, 31, 33, 64, 100, 192, 300])
@pytest.mark.parametrize(
    "out_features, in_features, bias", [(16, 32, False), (48, 64, True), (960, 576, False), (576, 1536, True)]
)
def test_matches_f_linear(kernels, rows, out_features, in_features, bias):
    torch.manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features) / in_features**0.5).to(BF16)
    b = torch.randn(out_features).to(BF16) if bias else None
    x = torch.randn(rows, in_features).to(BF16)
    out = kernels.linear_amx(x, kernels.pack_linear_weight_amx(weight), b)
    assert_one_rounding_apart(out, F.linear(x, weight, b))


def test_strided_rows_and_empty_input(kernels):
    weight = torch.randn(32, 64).to(BF16)
    packed = kernels.pack_linear_weight_amx(weight)
    wide = torch.randn(5, 128).to(BF16)
    x = wide[:, 32:96]  # rows 128 elements apart
    assert_one_rounding_apart(kernels.linear_amx(x, packed, None), F.linear(x, weight))
    assert kernels.linear_amx(torch.empty(0, 64, dtype=BF16), packed, None).shape == (0, 32)


def test_bad_shapes_are_refused(kernels):
    with pytest.raises(RuntimeError, match="% 16"):
        kernels.pack_linear_weight_amx(torch.randn(24, 64).to(BF16))
    with pytest.raises(RuntimeError, match="% 32"):
        kernels.pack_linear_weight_amx(torch.randn(32, 48).to(BF16))
    packed = kernels.pack_linear_weight_amx(torch.randn(32, 64).to(BF16))
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear_amx(torch.randn(2, 32).to(BF16), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.linear_amx(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear_amx(torch.randn(2, 64).to(BF16), packed, torch.zeros(31, dtype=BF16))


def test_linear_layer_uses_amx_for_small_steps_and_onednn_above(kernels):
    if not can_pack_linear_weights(torch.device("cpu"), BF16):
        pytest.skip("this CPU's oneDNN has no native bf16")
    torch.manual_seed(0)
    layer = Linear(576, 960, bias=True, dtype=BF16)
    layer.weight.data.copy_(torch.randn(960, 576) / 24)
    layer.bias.data.copy_(torch.randn(960))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack_weight(batch_size_hint=64, release_original=True, amx_kernels=kernels)
    assert layer.amx_weight is not None and layer.weight.numel() == 0 and "amx" in repr(layer)
    small = torch.randn(AMX_LINEAR_MAX_ROWS, 576).to(BF16)
    assert torch.equal(layer(small), kernels.linear_amx(small, layer.amx_weight, layer.bias))
    large = torch.randn(AMX_LINEAR_MAX_ROWS + 1, 576).to(BF16)
    onednn = torch.ops.mkldnn._linear_pointwise(large, layer.packed_weight, layer.bias, "none", [], "")
    assert torch.equal(layer(large), onednn)
    for x in (small, large):
        assert_one_rounding_apart(layer(x), F.linear(x, weight, bias))


def test_shapes_the_tiles_cannot_take_stay_on_onednn(kernels):
    if not can_pack_linear_weights(torch.device("cpu"), BF16):
        pytest.skip("this CPU's oneDNN has no native bf16")
    layer = Linear(48, 40, dtype=BF16)  # 40 % 16 != 0 and 48 % 32 != 0
    layer.weight.data.copy_(torch.randn(40, 48))
    weight = layer.weight.detach().clone()
    layer.pack_weight(batch_size_hint=8, release_original=False, amx_kernels=kernels)
    assert layer.amx_weight is None and layer.packed_weight is not None
    x = torch.randn(3, 48).to(BF16)
    assert torch.equal(layer(x), F.linear(x, weight))
