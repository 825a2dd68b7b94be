"""Tensor-parallel slices without processes: how sizes split over ranks, and that each rank of the
default model loads exactly its slice of every weight (the ranks' slices put together are the
whole model, plain, int8 or kept in the GGUF file's format) with about 1/N of the weight bytes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import ModelConfig
from pagedserve.models.layers import Embedding, Linear, RowParallelLinear
from pagedserve.models.loader import load_model
from pagedserve.models.quantization import GroupQuantized, quantize_int4
from pagedserve.models.quantize_model import weight_bytes
from pagedserve.models.registry import ModelLoadError
from pagedserve.models.tensor_parallel import TensorParallel, even_slice


@pytest.mark.parametrize(("total", "world"), [(10, 3), (9, 2), (49152, 2), (5, 5), (1536, 4)])
def test_even_slices_cover_the_whole_once(total, world):
    slices = [even_slice(total, world, rank) for rank in range(world)]
    assert slices[0][0] == 0
    for (start, size), (next_start, _) in zip(slices, slices[1:]):
        assert start + size == next_start
    assert sum(size for _, size in slices) == total
    assert max(s for _, s in slices) - min(s for _, s in slices) <= 1


def test_heads_split_by_whole_gqa_groups():
    # 9 query heads reading 3 K/V heads (the default model): 2 + 1 groups of 3 over two ranks
    first, second = (TensorParallel(rank, 2).head_slice(9, 3) for rank in range(2))
    assert (first.q_start, first.num_heads, first.kv_start, first.num_kv_heads) == (0, 6, 0, 2)
    assert (second.q_start, second.num_heads, second.kv_start, second.num_kv_heads) == (6, 3, 2, 1)
    assert TensorParallel(3, 4).head_slice(32, 8).num_heads == 8
    with pytest.raises(ValueError, match="larger than the model's 3 K/V heads"):
        TensorParallel(0, 4).head_slice(9, 3)


def test_group_quantized_narrow():
    weight = torch.randn(48, 128)
    quant = quantize_int4(weight, 32, symmetric=False)
    full = quant.dequantize()
    assert torch.equal(quant.narrow(0, 16, 16).dequantize(), full[16:32])
    assert torch.equal(quant.narrow(1, 64, 64).dequantize(), full[:, 64:])
    with pytest.raises(ValueError, match="cut groups"):
        quant.narrow(1, 16, 64)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every Linear / Embedding weight as float32, dequantized where it is quantized."""
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, (Linear, Embedding)):
            quant = sub.quant
            out[name] = quant.dequantize() if isinstance(quant, GroupQuantized) else sub.weight.detach().float()
    return out


def _assemble(name: str, parts: list[torch.Tensor], rank_models: list[torch.nn.Module]) -> torch.Tensor:
    """The whole weight ``name`` from the ranks' slices ``parts``."""
    if name.endswith(("o_proj", "down_proj")):
        return torch.cat(parts, dim=1)  # row-parallel: input features
    offsets = [getattr(model.get_submodule(name), "shard_offsets", {}) for model in rank_models]
    if offsets[0]:  # fused q/k/v or gate/up: each rank holds a slice of each shard
        return torch.cat(
            [part.narrow(0, *rank[shard_id]) for shard_id in offsets[0] for part, rank in zip(parts, offsets)]
        )
    return torch.cat(parts)  # embedding, lm_head: vocabulary rows


@pytest.mark.slow
@pytest.mark.parametrize(("world", "quantization"), [(2, None), (3, None), (2, "gguf"), (2, "int8")])
def test_rank_slices_make_up_the_whole_model(world, quantization):
    config = ModelConfig(dtype="float32", quantization=quantization)
    whole = load_model(config, "cpu")
    ranks = [load_model(config, "cpu", TensorParallel(rank, world)) for rank in range(world)]
    assert sum(r.num_kv_heads for r in ranks) == whole.num_kv_heads == 3
    assert all(r.kv_heads_all_ranks == 3 for r in ranks)
    expected = _weights(whole.model)
    slices = [_weights(r.model) for r in ranks]
    assert set(slices[0]) == set(expected)
    for name, tensor in expected.items():
        assembled = _assemble(name, [s[name] for s in slices], [r.model for r in ranks])
        if quantization == "int8" and name.endswith(("o_proj", "down_proj")):
            # int8 scales are per output row over the rank's own input features: each within one step
            # of the whole row's quantization, not equal to it
            assert assembled.shape == tensor.shape
            step = tensor.abs().amax(dim=1, keepdim=True) / 127
            assert bool(((assembled - tensor).abs() <= step * 1.01).all()), name
        else:
            assert torch.equal(assembled, tensor), name
    layer = ranks[0].model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, RowParallelLinear) and isinstance(layer.mlp.down_proj, RowParallelLinear)
    # about 1/N of the weight bytes per rank (norms are replicated; attention splits by whole groups)
    whole_bytes = weight_bytes(whole.model)
    for r in ranks:
        assert weight_bytes(r.model) < whole_bytes * (1.6 / world)
    assert sum(weight_bytes(r.model) for r in ranks) < whole_bytes * 1.05


def test_more_ranks_than_kv_heads_is_refused():
    with pytest.raises(ModelLoadError, match="K/V heads"):
        load_model(ModelConfig(dtype="float32"), "cpu", TensorParallel(0, 4))
