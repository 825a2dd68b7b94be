"""Weight-only quantization of linear layers and the embedding: the formats, the load-time
quantizers, and the matmuls over them.

One representation covers every scheme: ``GroupQuantized`` holds integer values with one
scale (and optionally one zero-point) per group of ``group_size`` input features,
``W[n, k] = scales[n, k // g] * values[n, k] + zeros[n, k // g]``. ``int8`` (per output channel,
symmetric), ``int4`` (groups of 32 or 128, symmetric or with zero-points) and the GGUF block
formats (read in ``gguf_quants``) all become one. On a CPU with the C++ kernels
(AVX512-BF16) ``pack_for_cpu`` lays it out once for ``linear_quant_avx512`` (4-bit values two to
a byte, float16 scales; with AVX512-VNNI, 4-bit weights multiply int8-quantized activations); elsewhere (CUDA, other CPUs) the matmul dequantizes the weight and
runs the plain matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

QUANTIZATION_METHODS = ("none", "int8", "int4", "gguf")
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """How to store linear weights: ``method`` is one of QUANTIZATION_METHODS.

    ``int4`` groups ``group_size`` input features per scale; ``symmetric`` drops the zero-points.
    The lm_head (and the embedding, tied to it or not) is int8 per output row in ``int8`` and
    ``int4``; ``gguf`` keeps each tensor in the file's own format.
    """

    method: str = "none"
    group_size: int = 32
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, not {self.method!r}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization group size must be one of {INT4_GROUP_SIZES}, not {self.group_size}")


@dataclass(slots=True)
class GroupQuantized:
    """``W [N, K] = scales * values + zeros`` group by group; the portable (unpacked) form."""

    values: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // group_size] float32
    zeros: torch.Tensor | None  # [N, K // group_size] float32, or None (symmetric)
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        zeros = self.zeros.nbytes if self.zeros is not None else 0
        return self.values.nbytes + self.scales.nbytes + zeros

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in ``dtype``."""
        n, k = self.values.shape
        grouped = self.values.view(n, k // self.group_size, self.group_size).float() * self.scales.unsqueeze(-1)
        if self.zeros is not None:
            grouped = grouped + self.zeros.unsqueeze(-1)
        return grouped.view(n, k).to(dtype)

    def map_rows(self, fn) -> GroupQuantized:
        """The same weight with ``fn`` applied to the rows of values, scales and zeros (a permutation)."""
        zeros = fn(self.zeros) if self.zeros is not None else None
        return GroupQuantized(fn(self.values), fn(self.scales), zeros, self.group_size)

    def regroup(self, group_size: int) -> GroupQuantized:
        """The same weight with groups of ``group_size`` (a divisor of the current one): scales repeated."""
        if group_size == self.group_size:
            return self
        if self.group_size % group_size:
            raise ValueError(f"cannot regroup groups of {self.group_size} into groups of {group_size}")
        factor = self.group_size // group_size
        zeros = self.zeros.repeat_interleave(factor, dim=1) if self.zeros is not None else None
        return GroupQuantized(self.values, self.scales.repeat_interleave(factor, dim=1), zeros, group_size)

    def narrow(self, dim: int, start: int, size: int) -> GroupQuantized:
        """A copy of rows (``dim`` 0) or input features (``dim`` 1) ``[start, start + size)``: one rank's
        slice, holding no reference to the whole. Raises ValueError when input features would cut a group."""
        g = self.group_size
        if dim == 1 and (start % g or size % g):
            raise ValueError(f"input features [{start}, {start + size}) cut groups of {g}")
        group_start, groups = (start, size) if dim == 0 else (start // g, size // g)

        def part(t: torch.Tensor, first: int, length: int) -> torch.Tensor:
            return t.narrow(dim, first, length).clone()

        zeros = part(self.zeros, group_start, groups) if self.zeros is not None else None
        return GroupQuantized(part(self.values, start, size), part(self.scales, group_start, groups), zeros, g)

    @staticmethod
    def cat_rows(parts: list[GroupQuantized]) -> GroupQuantized:
        """Row-wise concatenation (fused q/k/v or gate/up shards); groups are made equal first."""
        group_size = min(part.group_size for part in parts)
        parts = [part.regroup(group_size) for part in parts]
        zeros = None
        if any(part.zeros is not None for part in parts):
            zeros = torch.cat([p.zeros if p.zeros is not None else torch.zeros_like(p.scales) for p in parts])
        return GroupQuantized(
            torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]), zeros, group_size
        )

    def to(self, device: torch.device | str) -> GroupQuantized:
        zeros = self.zeros.to(device) if self.zeros is not None else None
        return GroupQuantized(self.values.to(device), self.scales.to(device), zeros, self.group_size)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K] @ W.T (+ bias)``: dequantizes the weight each call (the portable path)."""
        return F.linear(x, self.dequantize(x.dtype), bias)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of W (an embedding lookup): ``[*ids.shape, K]`` in ``dtype``."""
        flat = ids.reshape(-1)
        n, k = flat.numel(), self.values.shape[1]
        rows = self.values[flat].view(n, k // self.group_size, self.group_size).float()
        rows = rows * self.scales[flat].unsqueeze(-1)
        if self.zeros is not None:
            rows = rows + self.zeros[flat].unsqueeze(-1)
        return rows.view(*ids.shape, k).to(dtype)


def quantize_int8(weight: torch.Tensor) -> GroupQuantized:
    """Symmetric int8 with one scale per output row (``[N, K]`` -> values in -127..127)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    values = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return GroupQuantized(values, scales, None, w.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool) -> GroupQuantized:
    """4-bit values per group of ``group_size`` inputs: symmetric (-8..7, scale = max|w| / 7) or
    with a zero-point (0..15 between the group's min and max)."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    grouped = w.view(n, k // group_size, group_size)
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scales = (grouped.abs().amax(dim=-1) / 7.0).clamp_min(tiny)  # [N, G]
        values = torch.round(grouped / scales.unsqueeze(-1)).clamp_(-8, 7)
        return GroupQuantized(values.to(torch.int8).view(n, k), scales, None, group_size)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)  # [N, G]
    scales = ((high - low) / 15.0).clamp_min(tiny)
    values = torch.round((grouped - low.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp_(0, 15)
    return GroupQuantized(values.to(torch.int8).view(n, k), scales, low, group_size)


@dataclass(slots=True)
class PackedQuantWeight:
    """A ``GroupQuantized`` weight in the layout of the C++ kernel ``linear_quant_avx512``."""

    qweight: torch.Tensor  # 4 bits: [N / 16, K / 4, 32] uint8; 8 bits: [N / 16, K / 2, 32] int8
    scales: torch.Tensor  # [N / 16, G, 16] float16
    zeros: torch.Tensor  # [N / 16, G, 16] float16, or empty
    bits: int
    group_size: int
    offset: int  # 4 bits: the stored nibble is value + offset
    out_features: int
    in_features: int
    kernels: ModuleType

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes + self.zeros.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # NOTE: 4-bit weights take int8 activations (per row and group) where the kernels have AVX512-VNNI
        return self.kernels.linear_quant_avx512(
            x, self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.offset, bias, self.bits == 4
        )

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of W, read back from the packed layout: ``[*ids.shape, K]`` in ``dtype``."""
        flat = ids.reshape(-1)
        slices, cols = flat // 16, flat % 16
        k = self.in_features
        if self.bits == 8:
            # [S, K/2, 16 (c), 2 (j)]: row (s, c) is [K/2, 2] = k in order
            values = self.qweight.view(-1, k // 2, 16, 2)[slices, :, cols].reshape(-1, k).float()
        else:
            # [S, K/4, 16 (c), 2 (j)] bytes: low nibble k = 4q + j, high nibble k = 4q + 2 + j
            raw = self.qweight.view(-1, k // 4, 16, 2)[slices, :, cols].to(torch.int16)  # [n, K/4, 2]
            values = torch.cat([raw & 0x0F, raw >> 4], dim=-1).reshape(-1, k).float() - self.offset
        groups = k // self.group_size
        scales = self.scales[slices, :, cols].float()  # [n, G]
        rows = values.view(-1, groups, self.group_size) * scales.unsqueeze(-1)
        if self.zeros.numel():
            rows = rows + self.zeros[slices, :, cols].float().unsqueeze(-1)
        return rows.view(*ids.shape, k).to(dtype)


def _packed_bits(weight: GroupQuantized) -> tuple[int, int]:
    """(bits, offset) of the packed layout: 4 where the values fit -8..7 or 0..15 (and groups are whole
    pairs of pairs), else 8."""
    low, high = int(weight.values.min()), int(weight.values.max())
    if weight.group_size % 4 == 0 and low >= -8 and high <= 15 and (high <= 7 or low >= 0):
        return 4, 8 if low < 0 else 0
    return 8, 0


def can_pack_for_cpu(weight: GroupQuantized) -> bool:
    """Whether ``linear_quant_avx512`` takes this weight: rows a multiple of 16, groups of an even width."""
    n, k = weight.shape
    return n % 16 == 0 and weight.group_size % 2 == 0 and k % weight.group_size == 0


def pack_for_cpu(weight: GroupQuantized, kernels: ModuleType) -> PackedQuantWeight:
    """Lay ``weight`` out for ``linear_quant_avx512``: 4 bits where the values fit, else 8."""
    n, k = weight.shape
    groups = k // weight.group_size
    bits, offset = _packed_bits(weight)

    def per_slice(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N / 16, G, 16] float16
        return t.view(n // 16, 16, groups).transpose(1, 2).to(torch.float16).contiguous()

    zeros = per_slice(weight.zeros) if weight.zeros is not None else torch.empty(0, dtype=torch.float16)
    if bits == 4:
        nibbles = (weight.values.to(torch.int16) + offset).to(torch.uint8)  # [N, K], 0..15
        # [N/16, 16 (c), K/4 (q), 2 (half), 2 (j)] -> [N/16, K/4, 16, 2 (j), 2 (half)]
        parts = nibbles.view(n // 16, 16, k // 4, 2, 2).permute(0, 2, 1, 4, 3)
        packed = (parts[..., 0] | (parts[..., 1] << 4)).reshape(n // 16, k // 4, 32).contiguous()
    else:
        # [N/16, 16 (c), K/2 (p), 2 (j)] -> [N/16, K/2, 16, 2]
        packed = weight.values.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32)
        packed = packed.contiguous()
    return PackedQuantWeight(packed, per_slice(weight.scales), zeros, bits, weight.group_size, offset, n, k, kernels)


QuantizedWeight = GroupQuantized | PackedQuantWeight
