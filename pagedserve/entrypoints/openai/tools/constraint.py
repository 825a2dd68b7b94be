"""The JSON schemas that force a valid call under structured (grammar-constrained) decoding, and the
parse of the constrained output back into ToolCalls.

``tool_choice: "required"``: the model writes a JSON array of ``{"name", "arguments"}`` objects (one
at most when ``parallel_tool_calls`` is false, else a bounded number: small models do not close an
open array and repeat calls until ``max_tokens``). A named ``tool_choice``: the model writes the
function's arguments object only. An empty ``parameters`` schema (``{}``) is constrained to an object.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from pagedserve.entrypoints.openai.tools.calls import ToolCall, dump_arguments, new_tool_call_id
from pagedserve.entrypoints.openai.tools.spec import FunctionTool, ToolRequest

__all__ = [
    "ToolCall",
    "call_from_named_output",
    "calls_from_required_output",
    "named_call_schema",
    "new_tool_call_id",
    "required_calls_schema",
]

_CUT_HINT = " (the output may have been cut by max_tokens)"


def _arguments_schema(tool: FunctionTool) -> dict[str, Any]:
    return copy.deepcopy(tool.parameters) or {"type": "object"}


def required_calls_schema(request: ToolRequest, max_calls: int = 0) -> dict[str, Any]:
    """A non-empty array of calls, each naming one of the tools with that tool's arguments: one call
    without ``parallel_tool_calls``, else at most ``max_calls`` (0: as many as there are tools)."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": _arguments_schema(tool)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in request.tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    schema["maxItems"] = (max_calls or len(request.tools)) if request.parallel else 1
    return schema


def named_call_schema(request: ToolRequest) -> dict[str, Any]:
    """The arguments schema of the function a named ``tool_choice`` forces."""
    name = request.choice.name
    tool = request.tool(name) if name is not None else None
    if tool is None:
        raise ValueError(f"tool_choice {request.choice.mode!r} names no function of the request")
    return _arguments_schema(tool)


def _load(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"The {what} is not valid JSON{_CUT_HINT}: {exc}") from None


def calls_from_required_output(text: str) -> list[ToolCall]:
    """The calls of a ``tool_choice: "required"`` output (ValueError when it is not such an array)."""
    value = _load(text, "tool call array")
    if not isinstance(value, list) or not value:
        raise ValueError("The tool call output is not a non-empty JSON array of calls.")
    calls = []
    for index, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "arguments" not in item:
            raise ValueError(f"Tool call {index} is not an object with a string 'name' and 'arguments'.")
        calls.append(ToolCall(new_tool_call_id(), item["name"], dump_arguments(item["arguments"])))
    return calls


def call_from_named_output(name: str, text: str) -> ToolCall:
    """The call of a named ``tool_choice`` output: ``text`` is the arguments JSON."""
    return ToolCall(new_tool_call_id(), name, dump_arguments(_load(text, f"arguments output of {name!r}")))
