"""Reads a GGUF file's header: the key/value metadata as Python values and the tensor directory,
each tensor's data a read-only numpy view of the memory-mapped file (its pages read when used).

The header is parsed with ``struct`` over the mapping in one pass; a tokenizer's vocabulary (tens of
thousands of strings) takes milliseconds, where ``gguf.GGUFReader`` builds a numpy view per string.
Format: llama.cpp's GGUF, versions 2 and 3, little-endian. Type tables come from the ``gguf`` package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

SUPPORTED_VERSIONS = (2, 3)

# GGUF value type -> struct format of one scalar (little-endian)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# GGUF value type -> numpy dtype, for numeric arrays read in one go
_ARRAY_DTYPES = {code: np.dtype(fmt.replace("?", "b1")) for code, fmt in _SCALAR_FORMATS.items()}
# ggml types stored as plain numbers (anything else is rows of quantized blocks, read as bytes)
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (bad magic, version, or a truncated header)."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    data: np.ndarray  # numpy order (outermost first); [..., row_bytes] uint8 for block-quantized types


@dataclass(frozen=True, slots=True)
class GGUFFile:
    version: int
    metadata: dict[str, Any]  # key -> str | int | float | bool | list of those (nested for arrays of arrays)
    tensors: list[GGUFTensor]  # in file order


class _Cursor:
    """A read position over the mapped bytes."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error as exc:
            raise GGUFFormatError(f"truncated header at byte {self.offset}") from exc
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise GGUFFormatError(f"a string of {length} bytes at byte {self.offset} runs past the end of the file")
        raw = self.buffer[self.offset : end]
        self.offset = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {self.offset - length} is not UTF-8") from exc

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise GGUFFormatError(f"unknown GGUF value type {value_type} at byte {self.offset}")
        return self.unpack(fmt)

    def array(self) -> list[Any]:
        item_type = self.unpack("<I")
        count = self.unpack("<Q")
        dtype = _ARRAY_DTYPES.get(item_type)
        if dtype is None:
            return [self.value(item_type) for _ in range(count)]
        end = self.offset + count * dtype.itemsize
        if end > len(self.buffer):
            raise GGUFFormatError(f"an array of {count} values at byte {self.offset} runs past the end of the file")
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset).tolist()
        self.offset = end
        return values


def read_gguf_file(path: str) -> GGUFFile:
    """Parse the header of the GGUF file at ``path``; tensor data stays mapped, not read.

    Raises ``OSError`` when the file cannot be opened and ``GGUFFormatError`` when it is not a
    readable GGUF file.
    """
    with open(path, "rb") as file:
        try:
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise GGUFFormatError("the file is empty") from exc
    cursor = _Cursor(buffer)
    if cursor.unpack("<I") != GGUF_MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    version = cursor.unpack("<I")
    if version & 0xFFFF == 0:
        raise GGUFFormatError("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
    tensor_count = cursor.unpack("<Q")
    kv_count = cursor.unpack("<Q")

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))

    directory = []
    for _ in range(tensor_count):
        name = cursor.string()
        num_dims = cursor.unpack("<I")
        shape = tuple(cursor.unpack("<Q") for _ in range(num_dims))
        type_code = cursor.unpack("<I")
        offset = cursor.unpack("<Q")
        try:
            tensor_type = GGMLQuantizationType(type_code)
        except ValueError as exc:
            raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {type_code}") from exc
        directory.append((name, tensor_type, shape, offset))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two; got {alignment!r}")
    data_start = -(-cursor.offset // alignment) * alignment
    file_bytes = np.frombuffer(buffer, dtype=np.uint8)  # keeps the mapping alive as long as a view does

    tensors, names = [], set()
    for name, tensor_type, shape, offset in directory:
        if name in names:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(_tensor(file_bytes, data_start + offset, name, tensor_type, shape))
    return GGUFFile(version=version, metadata=metadata, tensors=tensors)


def _tensor(
    file_bytes: np.ndarray, start: int, name: str, tensor_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> GGUFTensor:
    numpy_shape = tuple(reversed(shape))
    dtype = _PLAIN_TENSOR_DTYPES.get(tensor_type)
    if dtype is not None:
        num_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    else:
        block_values, block_bytes = GGML_QUANT_SIZES[tensor_type]
        if not numpy_shape or numpy_shape[-1] % block_values:
            raise GGUFFormatError(
                f"tensor {name!r}: rows of {shape[:1]} values are not whole {tensor_type.name} blocks"
            )
        numpy_shape = (*numpy_shape[:-1], numpy_shape[-1] // block_values * block_bytes)
        num_bytes = int(np.prod(numpy_shape, dtype=np.int64))
        dtype = np.uint8
    if start + num_bytes > file_bytes.size:
        raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
    data = file_bytes[start : start + num_bytes].view(dtype).reshape(numpy_shape)
    return GGUFTensor(name=name, tensor_type=tensor_type, shape=shape, data=data)
