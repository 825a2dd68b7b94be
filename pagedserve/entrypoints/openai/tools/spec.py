"""The request's tool fields (``tools``, ``tool_choice``, ``parallel_tool_calls``, raw JSON values as
pydantic's ``Any`` fields hold them) -> a validated, frozen ToolRequest; every user error is a 400
naming its field. Only the shape of each ``parameters`` schema is checked (a JSON object)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedserve.entrypoints.serving.errors import bad_request

ToolChoiceMode = Literal["none", "auto", "required", "named"]

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names (fullmatch)
_STRING_MODES = ("none", "auto", "required")


def default_parameters() -> dict[str, Any]:
    """The schema of a function declared without ``parameters``: no arguments."""
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=default_parameters)

    def to_openai(self) -> dict[str, Any]:
        """The tool as a chat template's ``tools`` entry (OpenAI's request shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode
    name: str | None = None  # the function of a "named" choice

    def __post_init__(self) -> None:
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("a named tool choice, and only it, has a name")


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool.name for tool in self.tools)

    def tool(self, name: str) -> FunctionTool | None:
        return next((tool for tool in self.tools if tool.name == name), None)


def parse_tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The validated tool fields; None when the request gives no tools (or an empty list)."""
    parallel = _parse_parallel(parallel_tool_calls)
    parsed = _parse_tools(tools)
    choice = _parse_choice(tool_choice, parsed)
    if not parsed:
        return None
    return ToolRequest(parsed, choice, parallel)


def _parse_parallel(value: Any) -> bool:
    if value is None:
        return True  # OpenAI's default
    if not isinstance(value, bool):
        raise bad_request("parallel_tool_calls must be a boolean.", "parallel_tool_calls")
    return value


def _parse_tools(tools: Any) -> tuple[FunctionTool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad_request("tools must be an array of tools.", "tools")
    parsed: list[FunctionTool] = []
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        function = _parse_tool(index, tool)
        if function.name in seen:
            raise bad_request(
                f"tools[{index}].function.name: duplicate function name {function.name!r}.",
                f"tools[{index}].function.name",
            )
        seen.add(function.name)
        parsed.append(function)
    return tuple(parsed)


def _parse_tool(index: int, tool: Any) -> FunctionTool:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object.", where)
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type must be 'function', got {tool.get('type')!r}.", f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object.", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"{where}.function.name must be 1 to 64 characters of a-z, A-Z, 0-9, '_' or '-', got {name!r}.",
            f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string.", f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = default_parameters()
    elif not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object.", f"{where}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict must be a boolean.", f"{where}.function.strict")
    return FunctionTool(name, description, parameters)


def _parse_choice(choice: Any, tools: tuple[FunctionTool, ...]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in _STRING_MODES:
            raise bad_request(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}.", "tool_choice"
            )
        parsed = ToolChoice(choice)  # type: ignore[arg-type]
    else:
        parsed = ToolChoice("named", _named_choice(choice))
    if parsed.mode != "none" and not tools:
        raise bad_request(f"tool_choice {_describe(parsed)} requires `tools`.", "tool_choice")
    if parsed.name is not None and parsed.name not in {tool.name for tool in tools}:
        raise bad_request(f"tool_choice names the function {parsed.name!r}, which is not among `tools`.", "tool_choice")
    return parsed


def _named_choice(choice: Any) -> str:
    shape = 'tool_choice must be a string or {"type": "function", "function": {"name": ...}}.'
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise bad_request(shape, "tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(shape, "tool_choice")
    return function["name"]


def _describe(choice: ToolChoice) -> str:
    return f"for the function {choice.name!r}" if choice.name is not None else repr(choice.mode)
