"""Tools in the prompt: template detection, the default block, and the conversation for either kind
of template (rendered with Jinja here, as Transformers would)."""

from __future__ import annotations

import copy
import json

import jinja2
import pytest

from pagedserve.entrypoints.openai.tools.parsers.hermes import HermesToolParser
from pagedserve.entrypoints.openai.tools.prompt import (
    default_tools_system_block,
    messages_with_tools,
    template_supports_tools,
)
from pagedserve.entrypoints.openai.tools.spec import FunctionTool
from pagedserve.entrypoints.serving.errors import APIError

# SmolLM2-Instruct's ChatML template: prints every role, ignores tools
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# a small template of the kind that renders tools and tool calls itself
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}\n"
    "{% endfor %}"
)
TOOLS = [
    FunctionTool("get_weather", "Current weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
    FunctionTool("ping"),
]
CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_abc"},
]


def render(template: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    return jinja2.Environment().from_string(template).render(messages=messages, tools=tools, add_generation_prompt=True)


def test_template_detection() -> None:
    assert not template_supports_tools(None)
    assert not template_supports_tools("")
    assert not template_supports_tools(CHATML)
    assert template_supports_tools(TOOLS_TEMPLATE)
    assert template_supports_tools("{{ tools | tojson }}")
    # the word in literal text is not a reference, nor a variable the template defines itself
    assert not template_supports_tools("You have no tools. {{ messages[0].content }}")
    assert not template_supports_tools("{% set tools = [] %}{{ tools }}")


def test_template_detection_fallback_on_unknown_tags() -> None:
    generation = "{% generation %}{{ m }}{% endgeneration %}"
    assert template_supports_tools("{% if tools %}x{% endif %}" + generation)
    assert not template_supports_tools("no tools here " + generation)


def test_default_block_lists_functions() -> None:
    block = default_tools_system_block(TOOLS)
    listing = block.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in listing] == [
        {"name": "get_weather", "description": "Current weather", "parameters": TOOLS[0].parameters},
        {"name": "ping", "parameters": {"type": "object", "properties": {}}},
    ]
    assert "<tool_call>" in block and "</tool_call>" in block and '"arguments"' in block


def test_chatml_conversation() -> None:
    original = copy.deepcopy(CONVERSATION)
    messages = messages_with_tools(CONVERSATION, TOOLS, supports_tools=False)
    assert CONVERSATION == original  # inputs untouched
    system, user, assistant, tool = messages
    assert system["role"] == "system"
    assert system["content"].startswith(default_tools_system_block(TOOLS))
    assert system["content"].endswith("\n\nBe brief.")
    assert user == CONVERSATION[1]
    assert "tool_calls" not in assistant
    assert assistant["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert tool == {
        "role": "tool",
        "content": '<tool_response>\n{"temp": 3}\n</tool_response>',
        "tool_call_id": "call_abc",
    }
    prompt = render(CHATML, messages)
    assert "<|im_start|>tool\n<tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_rendered_calls_read_back_by_hermes() -> None:
    calls = [CALL, {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]
    messages = messages_with_tools([{"role": "assistant", "content": "Checking.", "tool_calls": calls}], None, False)
    extracted = HermesToolParser().extract(messages[0]["content"])
    assert extracted.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("ping", {}),
    ]


def test_system_message_inserted_when_first_is_not_system() -> None:
    messages = messages_with_tools([{"role": "user", "content": "hi"}], TOOLS, supports_tools=False)
    assert messages == [
        {"role": "system", "content": default_tools_system_block(TOOLS)},
        {"role": "user", "content": "hi"},
    ]


def test_no_tools_no_block() -> None:
    messages = messages_with_tools(CONVERSATION, None, supports_tools=False)
    assert messages[0] == CONVERSATION[0]
    assert messages[3]["content"].startswith("<tool_response>")
    assert messages_with_tools(CONVERSATION[:2], [], supports_tools=False) == CONVERSATION[:2]


def test_tools_template_conversation() -> None:
    messages = messages_with_tools(CONVERSATION, TOOLS, supports_tools=True)
    assert messages[0] == CONVERSATION[0] and messages[1] == CONVERSATION[1] and messages[3] == CONVERSATION[3]
    assert messages[2]["tool_calls"] == [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    prompt = render(TOOLS_TEMPLATE, messages, [t.to_openai() for t in TOOLS])
    assert prompt.startswith("TOOLS:get_weather;ping;\n")
    assert "[assistant]<call get_weather Oslo>" in prompt
    assert '[tool]{"temp": 3}' in prompt


def test_call_arguments_as_object_and_without_id_accepted() -> None:
    call = {"function": {"name": "ping", "arguments": {"x": 1}}}
    messages = messages_with_tools([{"role": "assistant", "content": "", "tool_calls": [call]}], None, True)
    assert messages[0]["tool_calls"] == [{"type": "function", "function": {"name": "ping", "arguments": {"x": 1}}}]
    empty = {"id": "c", "type": "function", "function": {"name": "ping", "arguments": ""}}
    messages = messages_with_tools([{"role": "assistant", "content": None, "tool_calls": [empty]}], None, False)
    assert messages[0]["content"] == '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def test_tool_message_without_call_id_accepted() -> None:
    messages = messages_with_tools([{"role": "tool", "content": "42"}], None, supports_tools=False)
    assert messages == [{"role": "tool", "content": "<tool_response>\n42\n</tool_response>"}]


def test_empty_or_null_tool_calls_are_no_calls() -> None:
    for calls in (None, []):
        message = {"role": "assistant", "content": "hi", "tool_calls": calls}
        assert messages_with_tools([message], None, False) == [{"role": "assistant", "content": "hi"}]


@pytest.mark.parametrize(
    "calls",
    [
        "not a list",
        ["call"],
        [{"type": "retrieval", "function": {"name": "f", "arguments": "{}"}}],
        [{"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        [{"id": "c", "type": "function"}],
        [{"id": "c", "type": "function", "function": {"arguments": "{}"}}],
        [{"id": "c", "type": "function", "function": {"name": "", "arguments": "{}"}}],
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}],
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}],
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": 7}}],
    ],
)
@pytest.mark.parametrize("supports_tools", [False, True])
def test_malformed_tool_calls(calls: object, supports_tools: bool) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    with pytest.raises(APIError) as info:
        messages_with_tools(messages, TOOLS, supports_tools)
    assert info.value.status == 400
    assert info.value.param == "messages[1].tool_calls"


def test_tool_calls_only_on_assistant_messages() -> None:
    with pytest.raises(APIError) as info:
        messages_with_tools([{"role": "user", "content": "x", "tool_calls": [CALL]}], None, True)
    assert info.value.param == "messages[0].tool_calls"


def test_non_text_content_refused_where_it_is_rewritten() -> None:
    with pytest.raises(APIError) as info:
        messages_with_tools([{"role": "tool", "content": [{"type": "text"}]}], None, False)
    assert info.value.param == "messages[0].content"
