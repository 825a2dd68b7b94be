"""GGUF block formats read into ``GroupQuantized`` without losing a bit of the stored integers.

Each supported ggml type is a run of fixed-size blocks per tensor row; this module decodes a
tensor's raw bytes ``[rows, row_bytes]`` into integer values with one float scale (and
zero-point) per group:

  Q8_0  32 values: float16 d, 32 int8            w = d * q
  Q4_0  32 values: float16 d, 16 bytes of nibbles w = d * (q - 8)
  Q4_1  32 values: float16 d, float16 m, nibbles  w = d * q + m
  Q4_K  256 values in 8 groups of 32: float16 d and dmin, 6-bit scales and mins, nibbles
                                                  w = (d * sc) * q - (dmin * mn)
  Q6_K  256 values in 16 groups of 16: 4 low bits, 2 high bits, int8 scales, float16 d
                                                  w = (d * sc) * (q - 32)

Other types are not kept (the loader dequantizes them instead).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.models.quantization import GroupQuantized

# ggml type name -> (values per block, bytes per block)
GGUF_KEPT_TYPES: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}


def _half(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` bytes -> ``[...]`` float32 from little-endian float16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """``[..., n]`` bytes -> ``[..., 2n]``: the n low nibbles, then the n high nibbles."""
    return np.concatenate([raw & 0x0F, raw >> 4], axis=-1)


def _q8_0(blocks: np.ndarray):
    values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return values, _half(blocks[..., 0:2]), None


def _q4_0(blocks: np.ndarray):
    values = _nibbles(blocks[..., 2:]).astype(np.int8) - np.int8(8)
    return values, _half(blocks[..., 0:2]), None


def _q4_1(blocks: np.ndarray):
    return _nibbles(blocks[..., 4:]).astype(np.int8), _half(blocks[..., 0:2]), _half(blocks[..., 2:4])


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins: groups 0-3 in the low 6 bits of bytes
    0-3 (scales) and 4-7 (mins); groups 4-7 from the nibbles of bytes 8-11 plus the top 2 bits
    of bytes 0-3 (scales) and 4-7 (mins)."""
    low_sc, low_mn, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low_sc & 0x3F, (extra & 0x0F) | ((low_sc >> 6) << 4)], axis=-1)
    mins = np.concatenate([low_mn & 0x3F, (extra >> 4) | ((low_mn >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks: np.ndarray):
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [rows, nb]
    sc, mn = _q4_k_scales(blocks[..., 4:16])  # [rows, nb, 8]
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)  # low nibbles: group 2j, high: group 2j + 1
    values = _nibbles(qs).astype(np.int8)  # [rows, nb, 4, 64] = 8 groups of 32 in order
    return values, d[..., None] * sc, -(dmin[..., None] * mn)


def _q6_k(blocks: np.ndarray):
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 64)  # per half of 128 values
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, nb, 16]
    d = _half(blocks[..., 208:210])
    low = _nibbles(ql)  # [rows, nb, 2, 128]: element e of a half takes ql[e] (e < 64) or ql[e - 64] >> 4
    high = (
        qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    ) & 0x03  # [rows, nb, 2, 4, 32]: bits 2c of qh[e % 32]
    values = (low | (high.reshape(*lead, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    return values, d[..., None] * scales, None


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
_GROUP_SIZES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q6_K": 16}


def decode_gguf_tensor(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GroupQuantized:
    """A 2-D GGUF tensor ``shape = (rows, cols)`` of a kept type from its raw bytes."""
    if type_name not in GGUF_KEPT_TYPES:
        raise ValueError(f"GGUF type {type_name} is not kept quantized (kept: {', '.join(GGUF_KEPT_TYPES)})")
    block_values, block_bytes = GGUF_KEPT_TYPES[type_name]
    rows, cols = shape
    if cols % block_values:
        raise ValueError(f"a row of {cols} values is not a whole number of {type_name} blocks")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // block_values, block_bytes)
    values, scales, zeros = _DECODERS[type_name](blocks)
    return GroupQuantized(
        values=torch.from_numpy(np.ascontiguousarray(values).reshape(rows, cols)),
        scales=torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, -1)),
        zeros=None
        if zeros is None
        else torch.from_numpy(np.ascontiguousarray(zeros, dtype=np.float32).reshape(rows, -1)),
        group_size=_GROUP_SIZES[type_name],
    )
