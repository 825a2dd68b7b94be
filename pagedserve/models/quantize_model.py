"""Quantizing a loaded model: its linear layers and embedding switched to quantized weights
(``quantize_model``), those packed for the C++ CPU kernel (``pack_quantized_weights``), and the
resident weight bytes reported at start-up (``weight_bytes``).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pagedserve.models.layers import Embedding, Linear
from pagedserve.models.quantization import (
    GroupQuantized,
    PackedQuantWeight,
    QuantizationConfig,
    can_pack_for_cpu,
    pack_for_cpu,
    quantize_int4,
    quantize_int8,
)


def quantize_model(model: nn.Module, config: QuantizationConfig) -> int:
    """Give ``model``'s linear layers and embedding quantized weights and release the plain ones.

    ``int8`` / ``int4`` quantize the loaded weights (the lm_head and the embedding in int8 per
    row either way); ``gguf`` installs the tensors the GGUF loader kept in their own format (a
    layer whose tensors it could not keep stays in the model dtype). Returns how many modules
    hold quantized weights.
    """
    if config.method == "none":
        return 0
    lm_head = getattr(model, "lm_head", None)
    embedding = next((m for m in model.modules() if isinstance(m, Embedding)), None)
    tied = lm_head is not None and embedding is not None and lm_head.weight is embedding.weight
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        if config.method == "gguf":
            module.install_staged_quant()
        elif module is lm_head or config.method == "int8":
            module.quant = quantize_int8(module.weight)
        else:
            module.quant = quantize_int4(module.weight, config.group_size, config.symmetric)
    if embedding is not None:
        if config.method == "gguf":
            embedding.install_staged_quant()
        if tied and lm_head.quant is not None:
            embedding.quant = lm_head.quant
        elif tied and embedding.quant is not None:
            lm_head.quant = embedding.quant
        elif embedding.quant is None and config.method != "gguf":
            embedding.quant = quantize_int8(embedding.weight)
    count = 0
    for module in model.modules():
        if isinstance(module, (Linear, Embedding)) and module.quant is not None:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
            count += 1
    return count


def pack_quantized_weights(model: nn.Module, kernels: ModuleType) -> int:
    """Lay every quantized weight out for ``linear_quant_avx512`` (one copy for a tied embedding
    and lm_head); returns how many modules now use the packed form."""
    packed: dict[int, PackedQuantWeight] = {}
    count = 0
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if isinstance(quant, GroupQuantized) and can_pack_for_cpu(quant):
            if id(quant) not in packed:
                packed[id(quant)] = pack_for_cpu(quant, kernels)
            module.quant = packed[id(quant)]
            count += 1
    return count


def _tensor_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of a tensor's storage; oneDNN's opaque tensors count their elements."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return id(tensor), tensor.numel() * tensor.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights: parameters, buffers, packed and quantized copies, each storage once."""
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for attribute in ("packed_weight", "amx_weight", "vnni_weight"):
            if getattr(module, attribute, None) is not None:
                tensors.append(getattr(module, attribute))
        quant = getattr(module, "quant", None)
        if isinstance(quant, GroupQuantized):
            tensors += [quant.values, quant.scales] + ([quant.zeros] if quant.zeros is not None else [])
        elif isinstance(quant, PackedQuantWeight):
            tensors += [quant.qweight, quant.scales, quant.zeros]
    sizes = dict(_tensor_bytes(t) for t in tensors if t.numel() > 0)
    return sum(sizes.values())
