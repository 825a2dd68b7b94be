"""The chat handler's tool plan: which parser "auto" gets as served, the forced schemas' call bound,
and the stream of a named choice (its arguments sent as they come, after one delta naming the call)."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.tool_calls import ToolCallingOptions, plan_tools
from pagedserve.entrypoints.serving.errors import APIError

TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[TOOL], **fields)


def test_auto_parses_hermes_when_the_template_ignores_tools() -> None:
    options = ToolCallingOptions.for_template(False, None, 0, template_supports_tools=False)
    plan = plan_tools(chat(), options)
    assert plan.mode == "auto"
    content, calls = plan.calls_of('<tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call>')
    assert [c.name for c in calls] == ["lookup"] and json.loads(calls[0].arguments) == {"q": "x"}
    assert plan.finish_reason("stop", len(calls)) == "tool_calls"


def test_auto_needs_the_flags_when_the_template_renders_tools() -> None:
    options = ToolCallingOptions.for_template(False, None, 0, template_supports_tools=True)
    with pytest.raises(APIError, match="enable-auto-tool-choice"):
        plan_tools(chat(), options)
    assert plan_tools(chat(tool_choice="required"), options).mode == "required"


def test_required_schema_takes_the_server_bound() -> None:
    plan = plan_tools(chat(tool_choice="required"), ToolCallingOptions(max_parallel_calls=3))
    assert plan.constraint_schema()["maxItems"] == 3
    plan = plan_tools(chat(tool_choice="required", parallel_tool_calls=False), ToolCallingOptions(max_parallel_calls=3))
    assert plan.constraint_schema()["maxItems"] == 1


def test_named_stream_sends_arguments_as_they_come() -> None:
    choice = {"type": "function", "function": {"name": "lookup"}}
    stream = plan_tools(chat(tool_choice=choice), ToolCallingOptions()).streamer()
    pieces = [stream.feed(text) for text in ['{"q": ', "", '"paris"}']] + [stream.finish()]
    sent = [call for delta in pieces for call in delta.tool_calls]
    assert [c.to_openai() for c in sent[1:]] == [{"index": 0, "function": {"arguments": '"paris"}'}}]
    first = sent[0].to_openai()
    assert (
        first["id"] and first["type"] == "function" and first["function"] == {"name": "lookup", "arguments": '{"q": '}
    )
    assert all(delta.content is None for delta in pieces) and stream.num_calls == 1
