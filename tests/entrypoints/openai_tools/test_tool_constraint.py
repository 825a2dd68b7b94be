"""The schemas that force a call, and the parse of constrained outputs into ToolCalls."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.entrypoints.openai.tools.constraint import (
    ToolCall,
    call_from_named_output,
    calls_from_required_output,
    named_call_schema,
    new_tool_call_id,
    required_calls_schema,
)
from pagedserve.entrypoints.openai.tools.spec import FunctionTool, ToolChoice, ToolRequest

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(choice: ToolChoice | None = None, parallel: bool = True) -> ToolRequest:
    tools = (FunctionTool("weather", "w", PARAMS), FunctionTool("ping", None, {}))
    return ToolRequest(tools, choice or ToolChoice("required"), parallel)


def test_required_schema_shape() -> None:
    schema = required_calls_schema(request())
    assert schema == {
        "type": "array",
        "minItems": 1,
        "maxItems": 2,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": "weather"}, "arguments": PARAMS},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"name": {"const": "ping"}, "arguments": {"type": "object"}},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                },
            ]
        },
    }
    json.dumps(schema)  # serializable as is


def test_required_schema_single_call_when_not_parallel() -> None:
    schema = required_calls_schema(request(parallel=False), max_calls=5)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1


def test_required_schema_call_bound_from_the_server() -> None:
    assert required_calls_schema(request(), max_calls=5)["maxItems"] == 5


def test_schema_is_a_copy() -> None:
    req = request()
    required_calls_schema(req)["items"]["anyOf"][0]["properties"]["arguments"]["properties"].clear()
    named_call_schema(request(ToolChoice("named", "weather")))["properties"].clear()
    assert req.tools[0].parameters == PARAMS


def test_named_schema() -> None:
    assert named_call_schema(request(ToolChoice("named", "weather"))) == PARAMS
    assert named_call_schema(request(ToolChoice("named", "ping"))) == {"type": "object"}
    with pytest.raises(ValueError):
        named_call_schema(request(ToolChoice("auto")))


def test_calls_from_required_output() -> None:
    text = ' [{"name": "weather", "arguments": {"city": "Zürich"}}, {"name": "ping", "arguments": {}}]\n'
    calls = calls_from_required_output(text)
    assert [(c.name, c.arguments) for c in calls] == [("weather", '{"city": "Zürich"}'), ("ping", "{}")]
    assert len({c.id for c in calls}) == 2
    assert json.loads(calls[0].arguments) == {"city": "Zürich"}


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "weather", "arguments": {"city": "Zü',  # cut by max_tokens
        "",
        "[]",
        '{"name": "weather", "arguments": {}}',
        '[{"arguments": {}}]',
        '[{"name": "weather"}]',
        '[{"name": 3, "arguments": {}}]',
        "[1]",
    ],
)
def test_bad_required_output(text: str) -> None:
    with pytest.raises(ValueError):
        calls_from_required_output(text)


def test_cut_output_message() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        calls_from_required_output('[{"name": "weather"')


def test_call_from_named_output() -> None:
    call = call_from_named_output("weather", '{ "city" : "東京" }')
    assert call.name == "weather" and call.arguments == '{"city": "東京"}'
    with pytest.raises(ValueError, match="max_tokens"):
        call_from_named_output("weather", '{"city": "Par')


def test_tool_call_shape_and_ids() -> None:
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert ToolCall("call_1", "f", "{}").to_openai() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
