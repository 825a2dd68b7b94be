"""ToolCall (one function call as OpenAI returns it), its ids, and the normalization of a call read
from model text (``{"name": ..., "arguments": ...}``) shared by the parsers."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

_ID_PREFIX = "call_"
ARGUMENT_KEYS = ("arguments", "parameters")


def new_tool_call_id() -> str:
    """``call_`` and 24 random hex digits."""
    return _ID_PREFIX + secrets.token_hex(12)


def dump_arguments(value: Any) -> str:
    """Arguments as the JSON string of ``function.arguments``."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: ``arguments`` is a JSON string (as in OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_fields(obj: Any, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call object a model wrote, or None when it is not one.

    The name must be a non-empty string. The arguments (the first of ``argument_keys`` present) must
    be a JSON object, given as an object or as a JSON string encoding one; absent or null means ``{}``.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments: Any = None
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, dump_arguments(arguments)
