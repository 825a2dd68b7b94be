"""CPU fast paths: linear weights packed once for oneDNN (no per-call reorder) and, where the CPU
has AMX, once more for the C++ AMX matmul of small steps, or, where it has AVX512-BF16 but no AMX,
instead for the C++ AVX512-BF16 matmul; and the fused C++ element-wise ops (RMSNorm with residual
add, rope, SiLU-and-mul) handed to the layers.

They give the same results as the plain PyTorch path up to float32 summation order (bit-identical
on the model's shapes at small batches in bf16). The model runner packs the weights of bf16 models
on a CPU that runs bf16 natively and of float32 models on any CPU with oneDNN (where PyTorch's own
float32 matmul, MKL's, runs its small-batch shapes at half oneDNN's speed on AVX2-only AMD
cores); the AMX copies and the fused ops are for bf16 only.
"""

from __future__ import annotations

import logging
from collections import Counter
from types import ModuleType

import torch
from torch import nn

from pagedserve.models.layers import Linear
from pagedserve.worker.host_memory import move_to_huge_pages

logger = logging.getLogger(__name__)


def can_pack_linear_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """True for a float32 model on a CPU with oneDNN, and for a bf16 one where oneDNN runs bf16
    natively (AVX-512 bf16 / AMX)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_linear_weights(model: nn.Module, batch_size_hint: int, kernels: ModuleType | None = None) -> int:
    """Give every ``Linear`` of ``model`` a packed weight; returns how many were packed.

    With ``kernels`` (the C++ CPU kernels) on a CPU whose OS grants AMX tiles, bf16 layers whose shapes
    fit the tiles also get the AMX layout, used for steps of up to ``AMX_LINEAR_MAX_ROWS`` tokens
    (another ``out x in`` bf16 copy per layer: +270 MB for SmolLM2-135M). Where the kernels were
    built with AVX512-BF16 and there is no AMX, bf16 layers get the AVX512-BF16 matmul's layout
    in place of oneDNN's (no second copy).

    A weight shared with another module (a tied embedding) keeps its plain copy next to the
    packed one (``vocab x hidden`` more bytes, ~57 MB for SmolLM2-135M); the others are released.
    Packing is for good: the model keeps the packed weights (and cannot load weights again).
    The AMX or AVX512-BF16 copies end up together on huge pages (``move_to_huge_pages``): a decode
    step streams every one of them, and on 4 KiB pages (no glibc huge-page malloc) the matmuls take
    measurably longer (oneDNN's copies are opaque tensors that stay where oneDNN put them).
    """
    uses = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    amx_kernels = kernels if kernels is not None and kernels.has_amx_linear() else None
    vnni_kernels = kernels if kernels is not None and amx_kernels is None and kernels.has_avx512_bf16_linear() else None
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and not module.is_packed:
            module.pack_weight(
                batch_size_hint,
                release_original=uses[id(module.weight)] == 1,
                amx_kernels=amx_kernels,
                vnni_kernels=vnni_kernels,
            )
            packed += 1
    for attribute in ("amx_weight", "vnni_weight"):
        _move_weights_to_huge_pages(model, attribute)
    logger.debug(
        "packed %d linear weights (AMX copies: %s, AVX512-BF16 layout: %s)",
        packed,
        amx_kernels is not None,
        vnni_kernels is not None,
    )
    return packed


def _move_weights_to_huge_pages(model: nn.Module, attribute: str) -> None:
    layers = [
        module for module in model.modules() if isinstance(module, Linear) and getattr(module, attribute) is not None
    ]
    weights = [getattr(layer, attribute) for layer in layers]
    for layer in layers:
        setattr(layer, attribute, None)  # the list holds the only reference: each original goes once copied
    for layer, weight in zip(layers, move_to_huge_pages(weights)):
        setattr(layer, attribute, weight)


def use_fused_ops(model: nn.Module, kernels: ModuleType) -> int:
    """Hand the compiled ops to every module with a ``fused_ops`` slot; returns how many took them.

    Does nothing when the extension was built without AVX-512 (``has_fused_bf16_ops()`` false).
    """
    if not kernels.has_fused_bf16_ops():
        return 0
    count = 0
    for module in model.modules():
        if hasattr(module, "fused_ops"):
            module.fused_ops = kernels
            count += 1
    logger.debug("fused bf16 ops enabled in %d modules", count)
    return count
