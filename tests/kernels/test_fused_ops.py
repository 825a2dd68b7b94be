"""The fused C++ bf16 ops against the PyTorch layers they replace, on odd shapes and extreme values."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary_emb
from tests.utils import assert_bf16_close

BF16 = torch.bfloat16


# the kernels fixture (conftest.py) skips this module without it
REQUIRED_KERNEL = ("has_fused_bf16_ops", "the fused bf16 ops are not built on this machine (no compiler or no AVX-512)")


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert_bf16_close(out, ref, atol=1e-6, max_mismatch=0.01)


@pytest.mark.parametrize("rows, hidden", [(1, 576), (3, 100), (40, 64), (17, 2048)])
def test_rms_norm_with_and_without_residual(kernels, rows, hidden):
    torch.manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5, dtype=BF16)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(rows, hidden).to(BF16)
    residual = (torch.randn(rows, hidden) * 4).to(BF16)
    ref_residual, fused_residual = residual.clone(), residual.clone()
    ref, _ = norm(x, ref_residual)
    out = kernels.rms_norm(x, fused_residual, norm.weight, norm.eps)
    assert torch.equal(fused_residual, ref_residual)  # the residual add is one bf16 rounding either way
    assert_close(out, ref)
    assert_close(kernels.rms_norm(x, None, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_in_place_on_a_qkv_view(kernels, head_dim):
    torch.manual_seed(head_dim)
    heads, kv_heads, tokens = 6, 2, 9
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, dtype=BF16)
    cos, sin = rope(torch.randint(0, 4096, (tokens,)))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(BF16)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    ref = apply_rotary_emb(qk, cos, sin)
    kernels.rotary_embedding_(qk, cos, sin)
    assert_close(qk.contiguous(), ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 24), (33, 100)])
def test_silu_and_mul_including_saturated_gates(kernels, rows, inter):
    torch.manual_seed(inter)
    x = (torch.randn(rows, 2 * inter) * 5).to(BF16)
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0], dtype=BF16)  # exp overflow / underflow in silu
    out = kernels.silu_and_mul(x)
    assert torch.isfinite(out.float()).all()
    assert_close(out, SiluAndMul()(x))


def test_bad_inputs_raise(kernels):
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.rms_norm(torch.randn(2, 8), None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="odd|2 \\* intermediate"):
        kernels.silu_and_mul(torch.randn(2, 7).to(BF16))
