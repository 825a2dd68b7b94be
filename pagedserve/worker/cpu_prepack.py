"""Pack a model's linear weights once for oneDNN on CPUs (bf16), so no matmul reorders them per call."""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from pagedserve.models.layers import Linear

logger = logging.getLogger(__name__)


def can_pack_linear_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """True on a CPU whose oneDNN runs bf16 natively (AVX-512 bf16 / AMX) and a bf16 model."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_linear_weights(model: nn.Module, batch_size_hint: int) -> int:
    """Give every ``Linear`` of ``model`` a packed weight; returns how many were packed.

    A weight shared with another module (a tied embedding) keeps its plain copy; the others
    are released, so packing costs no extra memory.
    """
    uses = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed_weight is None:
            module.pack_weight(batch_size_hint, release_original=uses[id(module.weight)] == 1)
            packed += 1
    logger.debug("packed %d linear weights for oneDNN", packed)
    return packed
