"""Schema rewrites and limits of structured outputs (pure Python, no grammar library)."""

from __future__ import annotations

import pytest

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured.schema_bounds import any_json_object_schema, bound_strings, schema_depth, unsupported_keyword


def test_bound_strings_adds_max_length_only_where_unbounded():
    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "short": {"type": "string", "maxLength": 5},
            "pattern": {"type": "string", "pattern": "^a+$"},
            "choice": {"type": "string", "enum": ["x", "y"]},
            "list": {"type": "array", "items": {"type": "string"}},
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        },
        "$defs": {"name": {"type": "string"}},
    }
    bounded = bound_strings(schema, 40)
    props = bounded["properties"]
    assert props["free"]["maxLength"] == 40
    assert props["short"]["maxLength"] == 5
    assert "maxLength" not in props["pattern"] and "maxLength" not in props["choice"]
    assert props["list"]["items"]["maxLength"] == 40
    assert props["either"]["anyOf"][0]["maxLength"] == 40
    assert bounded["$defs"]["name"]["maxLength"] == 40
    assert "maxLength" not in schema["properties"]["free"]  # the input is left alone
    assert bound_strings(schema, 0) is schema


def test_any_json_object_schema_is_bounded_in_size_and_depth():
    schema = any_json_object_schema(64, max_members=4, depth=2)
    assert schema["type"] == "object" and schema["maxProperties"] == 4
    assert schema["propertyNames"] == {"maxLength": 64}
    # two levels: the values of the root may be arrays / objects of scalars only
    nested = [s for s in schema["additionalProperties"]["anyOf"] if s.get("type") in ("array", "object")]
    assert {s["type"] for s in nested} == {"array", "object"}
    for container in nested:
        inner = container.get("items") or container["additionalProperties"]
        assert all(s["type"] in ("string", "number", "boolean", "null") for s in inner["anyOf"])
    assert schema_depth(schema) < 10


def test_schema_depth_and_unsupported_keywords():
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    assert schema_depth(deep) > 32
    assert schema_depth({"type": "object", "properties": {"a": {"type": "integer"}}}) == 1
    assert unsupported_keyword({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}) == (
        "uniqueItems",
        "#/properties/tags",
    )
    assert unsupported_keyword({"type": "array", "uniqueItems": False}) is None
    assert unsupported_keyword({"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]}) == ("not", "#/anyOf/1")
    assert unsupported_keyword({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}}) is None


def test_structured_outputs_params_need_exactly_one_spec():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(choice=("a", "b")).key == ("choice", ("a", "b"))
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar="root ::= 'a'")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=())
