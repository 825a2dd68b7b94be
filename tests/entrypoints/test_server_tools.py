"""Tool calling on a real `pagedserve serve` (hermes parser for "auto") through the `openai` client:
required and named choices forced through structured outputs return valid calls, streamed in
OpenAI's delta shape too (with every token's logprobs); a tool turn is accepted; bad tool choices get a 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def model_of(client) -> str:
    return client.models.list().data[0].id


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function" and call.function.name in PARAMS
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def constrained_count(server, kind: str) -> float:
    """pagedserve:structured_output_requests_total for ``kind`` (0 before the first such request)."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("pagedserve:structured_output_requests_total{") and f'kind="{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_required_choice_returns_valid_calls(server, client):
    tools_before, json_before = constrained_count(server, "tools"), constrained_count(server, "json")
    reply = client.chat.completions.create(
        model=model_of(client),
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0.8,
        n=2,
        max_tokens=200,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        check_calls(choice.message.tool_calls)
    assert constrained_count(server, "tools") == tools_before + 1
    assert constrained_count(server, "json") == json_before


def test_named_choice_returns_that_call(client):
    reply = client.chat.completions.create(
        model=model_of(client),
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    check_calls([call])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_calls_in_openai_delta_shape(client, choice):
    chunks = client.chat.completions.create(
        model=model_of(client),
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
    )
    calls: dict[int, dict] = {}
    finishes = []
    logprobs = []
    for chunk in chunks:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            if c.logprobs is not None:
                logprobs += c.logprobs.content
            for piece in c.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert finishes == (["tool_calls"] if choice == "required" else ["stop"])
    assert calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
    # every generated token's logprob arrives once, text held back by the call parser included
    assert len(logprobs) == completion_tokens > 0
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in logprobs)


def test_tool_turn_and_auto_choice(client):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(model=model_of(client), messages=messages, tools=[WEATHER], max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content


def test_bad_tool_choices_get_400(client):
    with pytest.raises(openai.BadRequestError, match="get_stock"):
        client.chat.completions.create(
            model=model_of(client),
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_stock"}},
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_of(client), messages=ASK, tool_choice="required")
