"""JSON-schema rewrites that keep constrained output finite, and the size limits of a spec.

Small models constrained to JSON tend to run on inside an unbounded string until ``max_tokens``;
strings the schema leaves unbounded get ``maxLength`` (a server setting), and "any JSON object"
is a schema of bounded strings, keys, sizes and depth.
"""

from __future__ import annotations

import copy
from typing import Any

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused
MAX_SCHEMA_DEPTH = 32  # nesting of objects / arrays in a schema
MAX_CHOICES = 512
MAX_CHOICE_CHARS = 1024

_SCHEMA_CHILD_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_CHILD_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_CHILDREN = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_STRING_BOUNDS = ("maxLength", "enum", "const", "pattern", "format")
# keywords the grammar cannot enforce: a schema using them is refused rather than silently loosened
UNSUPPORTED_KEYWORDS = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def unsupported_keyword(schema: Any, path: str = "#") -> tuple[str, str] | None:
    """The first keyword of UNSUPPORTED_KEYWORDS in ``schema`` and where: ``(keyword, json_pointer)``."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            return keyword, path
    for key, child in _named_children(schema, path):
        found = unsupported_keyword(child, key)
        if found is not None:
            return found
    return None


def schema_depth(schema: Any, depth: int = 0) -> int:
    """Deepest nesting of sub-schemas (stops counting past MAX_SCHEMA_DEPTH + 1)."""
    if depth > MAX_SCHEMA_DEPTH or not isinstance(schema, dict):
        return depth
    deepest = depth
    for child in _children(schema):
        deepest = max(deepest, schema_depth(child, depth + 1))
    return deepest


def bound_strings(schema: dict[str, Any], max_length: int) -> dict[str, Any]:
    """A copy of ``schema`` where every string sub-schema without a bound of its own (maxLength, enum,
    const, pattern, format) has ``maxLength: max_length``. ``max_length <= 0`` leaves it unchanged."""
    if max_length <= 0:
        return schema
    result = copy.deepcopy(schema)
    _bound_in_place(result, max_length)
    return result


def any_json_object_schema(max_length: int, max_members: int = 12, depth: int = 3) -> dict[str, Any]:
    """An object of JSON values ("json_object"), bounded so that a model cannot loop in it: strings and
    keys up to ``max_length`` characters (when > 0), up to ``max_members`` properties or items per
    object or array, and objects / arrays nested ``depth`` levels deep at most (scalars below)."""
    string: dict[str, Any] = {"type": "string"}
    names: dict[str, Any] = {}
    if max_length > 0:
        string["maxLength"] = max_length
        names["maxLength"] = max_length
    scalars: list[dict[str, Any]] = [string, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
    value: dict[str, Any] = {"anyOf": scalars}
    for _ in range(depth - 1):
        value = {
            "anyOf": [
                *scalars,
                {"type": "array", "items": value, "maxItems": max_members},
                {"type": "object", "additionalProperties": value, "propertyNames": names, "maxProperties": max_members},
            ]
        }
    return {"type": "object", "additionalProperties": value, "propertyNames": names, "maxProperties": max_members}


def _named_children(schema: dict[str, Any], path: str) -> list[tuple[str, Any]]:
    """The sub-schemas of ``schema`` with their JSON pointers under ``path``."""
    children: list[tuple[str, Any]] = []
    for key in _SCHEMA_CHILD_LISTS:
        if isinstance(schema.get(key), list):
            children.extend((f"{path}/{key}/{i}", child) for i, child in enumerate(schema[key]))
    for key in _SCHEMA_CHILD_MAPS:
        if isinstance(schema.get(key), dict):
            children.extend((f"{path}/{key}/{name}", child) for name, child in schema[key].items())
    for key in _SCHEMA_CHILDREN:
        if isinstance(schema.get(key), dict):
            children.append((f"{path}/{key}", schema[key]))
    if isinstance(schema.get("items"), list):
        children.extend((f"{path}/items/{i}", child) for i, child in enumerate(schema["items"]))
    return children


def _children(schema: dict[str, Any]) -> list[Any]:
    return [child for _, child in _named_children(schema, "")]


def _is_string_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and kind == ["string"])


def _bound_in_place(schema: Any, max_length: int) -> None:
    if not isinstance(schema, dict):
        return
    if _is_string_schema(schema) and not any(key in schema for key in _STRING_BOUNDS):
        schema["maxLength"] = max_length
    for child in _children(schema):
        _bound_in_place(child, max_length)
