"""The quantized matmul (4- and 8-bit weights, group-wise float16 scales, optional zero-points)
against F.linear over the same weight dequantized, for every shape class: one row, a row group
and its remainder, prefill-sized batches, odd group counts, biases; its refusals of bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.models.gguf_quants import decode_gguf_tensor
from pagedserve.models.quantization import pack_for_cpu, quantize_int4, quantize_int8
from tests.quantization.test_formats import random_blocks

BF16 = torch.bfloat16
REQUIRED_KERNEL = ("has_quant_linear", "the C++ kernels were not built with AVX512-BF16 here (or no compiler)")

FORMATS = {
    "int8-per-row": lambda w: quantize_int8(w),
    "int4-zero-points-g32": lambda w: quantize_int4(w, 32, False),
    "int4-symmetric-g32": lambda w: quantize_int4(w, 32, True),
    "int4-zero-points-g128": lambda w: (
        quantize_int4(w, 128, False) if w.shape[1] % 128 == 0 else quantize_int4(w, 32, False)
    ),
}


def int8_activations(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x as the int8-activation path sees it: per row and group, round(x * 127 / max|x|) * max|x| / 127."""
    rows = x.float().reshape(-1, x.shape[-1] // group_size, group_size)
    amax = rows.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(rows * inverse) * (amax / 127.0)).reshape(x.shape)


def reference(x: torch.Tensor, weight, bias: torch.Tensor | None, packed=None) -> torch.Tensor:
    """float32 matmul over the float32 weight the packed one stores (scales rounded to float16), and over
    int8-quantized activations where ``packed`` takes them."""
    if packed is not None and packed.bits == 4 and packed.kernels.has_int8_activation_linear():
        x = int8_activations(x, weight.group_size)
    n, k = weight.shape
    groups = k // weight.group_size
    scales = weight.scales.half().float()
    w = weight.values.float().view(n, groups, weight.group_size) * scales.unsqueeze(-1)
    if weight.zeros is not None:
        w = w + weight.zeros.half().float().unsqueeze(-1)
    return F.linear(x.float(), w.view(n, k), bias.float() if bias is not None else None)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    # float32 sums in another order, rounded once to bf16: within a bf16 rounding step of the largest output
    assert out.dtype == BF16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=float(ref.abs().max()) * 2**-8, rtol=2**-7)


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 16, 200])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("out_features, in_features, bias", [(16, 96, False), (48, 128, True), (960, 576, False)])
def test_matches_the_dequantized_matmul(kernels, rows, fmt, out_features, in_features, bias):
    torch.manual_seed(rows + out_features)
    weight = FORMATS[fmt](torch.randn(out_features, in_features) / in_features**0.5 + 0.01)
    packed = pack_for_cpu(weight, kernels)
    assert packed.bits == (8 if fmt.startswith("int8") else 4)
    x = torch.randn(rows, in_features).to(BF16)
    b = torch.randn(out_features).to(BF16) if bias else None
    assert_close_to_reference(packed.matmul(x, b), reference(x, weight, b, packed))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 16, 200])
def test_gguf_blocks_run_in_their_own_bit_width(kernels, type_name, rows):
    weight = decode_gguf_tensor(random_blocks(type_name, 32, 512, seed=7), type_name, (32, 512))
    packed = pack_for_cpu(weight, kernels)
    assert packed.bits == (8 if type_name in ("Q8_0", "Q6_K") else 4)
    assert packed.offset == (8 if type_name == "Q4_0" else 0)
    x = torch.randn(rows, 512).to(BF16)
    assert_close_to_reference(packed.matmul(x, None), reference(x, weight, None, packed))


def test_batched_strided_and_empty_input(kernels):
    weight = quantize_int4(torch.randn(32, 64), 32, False)
    packed = pack_for_cpu(weight, kernels)
    wide = torch.randn(5, 128).to(BF16)
    x = wide[:, 32:96]  # rows 128 elements apart
    assert_close_to_reference(packed.matmul(x, None), reference(x, weight, None, packed))
    batched = torch.randn(2, 3, 64).to(BF16)
    out = packed.matmul(batched, None)
    assert out.shape == (2, 3, 32)
    assert_close_to_reference(out, reference(batched, weight, None, packed))
    assert packed.matmul(torch.empty(0, 64, dtype=BF16), None).shape == (0, 32)


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_4bit_weights_with_and_without_int8_activations(kernels, rows):
    # the bf16-activation path is exact up to one rounding; the int8 one is exact on the quantized
    # activations, and within their quantization error (~1 %) of the bf16 result
    weight = quantize_int4(torch.randn(64, 256) / 16, 32, False)
    packed = pack_for_cpu(weight, kernels)
    x = torch.randn(rows, 256).to(BF16)
    call = kernels.linear_quant_avx512
    exact = call(x, packed.qweight, packed.scales, packed.zeros, 4, 32, packed.offset, None, False)
    assert_close_to_reference(exact, reference(x, weight, None))
    if kernels.has_int8_activation_linear():
        fast = call(x, packed.qweight, packed.scales, packed.zeros, 4, 32, packed.offset, None, True)
        assert_close_to_reference(fast, reference(int8_activations(x, 32), weight, None))
        assert (fast.float() - exact.float()).norm() < 0.02 * exact.float().norm()


def test_packed_lookup_reads_the_rows_back(kernels):
    for weight in (quantize_int8(torch.randn(48, 64)), quantize_int4(torch.randn(48, 64), 32, False)):
        packed = pack_for_cpu(weight, kernels)
        ids = torch.tensor([0, 15, 16, 47, 3])
        expected = reference(torch.eye(64), weight, None).t()[ids]  # rows of the stored weight
        torch.testing.assert_close(packed.lookup(ids, torch.float32), expected, atol=1e-6, rtol=1e-5)


def test_bad_input_is_refused(kernels):
    packed = pack_for_cpu(quantize_int4(torch.randn(32, 64), 32, False), kernels)
    with pytest.raises(RuntimeError, match="bfloat16"):
        packed.matmul(torch.randn(2, 64), None)  # float32 activations
    with pytest.raises(RuntimeError, match="features"):
        packed.matmul(torch.randn(2, 96).to(BF16), None)
    with pytest.raises(RuntimeError, match="bias"):
        packed.matmul(torch.randn(2, 64).to(BF16), torch.randn(16).to(BF16))
    with pytest.raises(RuntimeError, match="bits"):
        kernels.linear_quant_avx512(torch.randn(1, 64).to(BF16), packed.qweight, packed.scales, packed.zeros, 3, 32, 0)
