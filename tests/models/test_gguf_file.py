"""The GGUF header reader against the ``gguf`` package's own reader: every value type, arrays of
arrays, plain and block-quantized tensors, the default model's file; and clear errors for files it
cannot read."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from pagedserve.models.default_model import default_model_path
from pagedserve.models.gguf_file import GGUFFormatError, read_gguf_file
from pagedserve.models.gguf_loader import open_gguf
from pagedserve.models.registry import ModelLoadError


def reference_contents(path: str) -> tuple[dict, list]:
    reader = gguf.GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return metadata, reader.tensors


def assert_same_as_gguf_reader(path: str, nested: tuple[str, ...] = ()) -> None:
    """Equal to ``gguf.GGUFReader``'s reading, except that the keys ``nested`` (arrays of arrays) keep
    their nesting where that reader flattens them."""
    ours = read_gguf_file(path)
    metadata, tensors = reference_contents(path)
    mine = dict(ours.metadata)
    for key in nested:
        mine[key] = [item for inner in mine[key] for item in inner]
    assert mine == metadata
    assert [type(value) for value in mine.values()] == [type(value) for value in metadata.values()]
    assert [tensor.name for tensor in ours.tensors] == [tensor.name for tensor in tensors]
    for mine, theirs in zip(ours.tensors, tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(n) for n in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)
        assert not mine.data.flags.writeable


def test_every_value_type_and_tensor_kind_reads_as_the_gguf_package_reads_it(tmp_path):
    path = str(tmp_path / "kinds.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.yes", True)
    writer.add_bool("t.no", False)
    writer.add_string("t.text", "héllo 日本語 🙂")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [3, -1, 4])
    writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.strings", ["a", "", "ü", "<0x0A>"])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.no_items", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((4, 2)).astype(np.float16))
    writer.add_tensor("plain.i32", np.arange(7, dtype=np.int32))
    rows = rng.standard_normal((6, 64)).astype(np.float32)
    for quant in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        writer.add_tensor(f"blocks.{quant.name}", gguf.quants.quantize(rows, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert_same_as_gguf_reader(path, nested=("t.nested",))
    ours = read_gguf_file(path)
    assert ours.version == 3
    assert ours.metadata["t.text"] == "héllo 日本語 🙂" and ours.metadata["t.nested"] == [[1, 2], [3]]
    assert ours.metadata["t.yes"] is True and ours.metadata["t.u64"] == 2**63 + 5
    q4_1 = next(tensor for tensor in ours.tensors if tensor.name == "blocks.Q4_1")
    assert q4_1.shape == (64, 6) and q4_1.data.shape == (6, 2 * 20)  # two 20-byte blocks per row
    np.testing.assert_array_equal(
        gguf.quants.dequantize(q4_1.data, q4_1.tensor_type),
        gguf.quants.dequantize(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_1), q4_1.tensor_type),
    )


def test_the_default_model_reads_as_the_gguf_package_reads_it():
    assert_same_as_gguf_reader(default_model_path())


def header(version: int = 3, tensors: int = 0, kvs: int = 0) -> bytes:
    return struct.pack("<IIQQ", gguf.GGUF_MAGIC, version, tensors, kvs)


def key_value(key: str, value_type: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", value_type) + payload


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b"GGML" + bytes(20), "bad magic"),
        (header(version=1), "version 1"),
        (struct.pack("<I", gguf.GGUF_MAGIC) + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
        (header(kvs=1)[:-3], "truncated"),
        (header(kvs=1) + key_value("k", 8, struct.pack("<Q", 1000) + b"abc"), "runs past the end"),
        (header(kvs=1) + key_value("k", 99, b""), "unknown GGUF value type 99"),
        (header(kvs=1) + key_value("k", 8, struct.pack("<Q", 2) + b"\xff\xfe"), "not UTF-8"),
        (header(kvs=1) + key_value("k", 9, struct.pack("<IQ", 4, 10**9)), "runs past the end"),
        (header(kvs=1) + key_value("general.alignment", 4, struct.pack("<I", 24)), "power of two"),
    ],
)
def test_unreadable_files_raise_a_clear_error(tmp_path, content, message):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf_file(str(path))
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        open_gguf(str(path))


def test_a_tensor_past_the_end_of_the_file_is_refused(tmp_path):
    name = b"w"
    directory = struct.pack("<Q", len(name)) + name + struct.pack("<I", 1) + struct.pack("<Q", 1000)
    directory += struct.pack("<I", int(gguf.GGMLQuantizationType.F32)) + struct.pack("<Q", 0)
    path = tmp_path / "short.gguf"
    path.write_bytes(header(tensors=1) + directory)
    with pytest.raises(GGUFFormatError, match="runs past the end"):
        read_gguf_file(str(path))
