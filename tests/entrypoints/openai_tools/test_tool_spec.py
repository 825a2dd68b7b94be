"""parse_tool_request: tools, tool_choice and parallel_tool_calls -> ToolRequest, every user error a 400."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.openai.tools.spec import (
    FunctionTool,
    ToolChoice,
    ToolRequest,
    default_parameters,
    parse_tool_request,
)
from pagedserve.entrypoints.serving.errors import APIError

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name: str = "get_weather", **function: object) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def bad(tools: object = None, choice: object = None, parallel: object = None) -> APIError:
    with pytest.raises(APIError) as info:
        parse_tool_request(tools, choice, parallel)
    assert info.value.status == 400
    return info.value


def test_no_tools_is_none() -> None:
    assert parse_tool_request(None, None, None) is None
    assert parse_tool_request([], None, None) is None
    assert parse_tool_request(None, "none", None) is None
    assert parse_tool_request(None, None, False) is None


def test_tools_parsed_with_defaults() -> None:
    request = parse_tool_request(
        [tool(description="Weather now", parameters=WEATHER_PARAMS), tool("no_args")], None, None
    )
    assert request == ToolRequest(
        (
            FunctionTool("get_weather", "Weather now", WEATHER_PARAMS),
            FunctionTool("no_args", None, default_parameters()),
        ),
        ToolChoice("auto"),
        True,
    )
    assert request.names == ("get_weather", "no_args")
    assert request.tool("no_args").parameters == {"type": "object", "properties": {}}
    assert request.tool("missing") is None
    assert request.tools[0].to_openai() == {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_PARAMS},
    }


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("none", ToolChoice("none")),
        ("auto", ToolChoice("auto")),
        ("required", ToolChoice("required")),
        ({"type": "function", "function": {"name": "b"}}, ToolChoice("named", "b")),
    ],
)
def test_tool_choices(raw: object, expected: ToolChoice) -> None:
    request = parse_tool_request([tool("a"), tool("b")], raw, False)
    assert request.choice == expected
    assert request.parallel is False


def test_tool_choice_object_must_carry_name() -> None:
    with pytest.raises(ValueError):
        ToolChoice("named")
    with pytest.raises(ValueError):
        ToolChoice("auto", "f")


@pytest.mark.parametrize("name", ["", "a" * 65, "has space", "dot.name", "ünï", 5, None])
def test_bad_function_names(name: object) -> None:
    error = bad([tool(name)])
    assert error.param == "tools[0].function.name"


def test_name_limits_accepted() -> None:
    request = parse_tool_request([tool("a" * 64), tool("A-z_0-9")], None, None)
    assert request.names == ("a" * 64, "A-z_0-9")


def test_trailing_newline_in_name_refused() -> None:
    assert bad([tool("name\n")]).param == "tools[0].function.name"


def test_duplicate_names() -> None:
    error = bad([tool("f"), tool("g"), tool("f")])
    assert error.param == "tools[2].function.name"
    assert "'f'" in error.message


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"type": "function"}, "tools"),
        ([["not", "an", "object"]], "tools[0]"),
        ([{"function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "code_interpreter"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": "f"}], "tools[0].function"),
        ([tool("f"), tool(parameters=[1])], "tools[1].function.parameters"),
        ([tool(parameters="{}")], "tools[0].function.parameters"),
        ([tool(description=3)], "tools[0].function.description"),
        ([tool(strict="yes")], "tools[0].function.strict"),
    ],
)
def test_malformed_tools(tools: object, param: str) -> None:
    assert bad(tools).param == param


def test_strict_accepted() -> None:
    assert parse_tool_request([tool(strict=True)], None, None) is not None


def test_named_choice_must_be_a_tool() -> None:
    error = bad([tool("a")], {"type": "function", "function": {"name": "launch_rocket"}})
    assert error.param == "tool_choice"
    assert "launch_rocket" in error.message


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_choice_without_tools(choice: object) -> None:
    for tools in (None, []):
        error = bad(tools, choice)
        assert error.param == "tool_choice"
        assert "tools" in error.message


@pytest.mark.parametrize(
    "choice",
    [
        "any",
        "",
        5,
        ["auto"],
        {"type": "function"},
        {"type": "function", "function": {}},
        {"type": "function", "function": {"name": 3}},
        {"type": "function", "name": "f"},
        {"function": {"name": "f"}},
    ],
)
def test_malformed_choice(choice: object) -> None:
    assert bad([tool("f")], choice).param == "tool_choice"


def test_malformed_choice_reported_without_tools() -> None:
    assert bad(None, "any").param == "tool_choice"


@pytest.mark.parametrize("parallel", ["true", 1, 0, [True]])
def test_malformed_parallel(parallel: object) -> None:
    assert bad([tool()], None, parallel).param == "parallel_tool_calls"
