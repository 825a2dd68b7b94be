"""Tools and tool turns in the prompt: whether a chat template renders ``tools`` itself, a default
system block (hermes style) for templates that do not, and the conversation handed to the template
(assistant ``tool_calls`` and ``tool`` messages rendered for either kind of template)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2 import meta

from pagedserve.entrypoints.openai.tools.spec import FunctionTool
from pagedserve.entrypoints.serving.errors import bad_request

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# the fallback test: the word `tools` inside a {{ ... }} or {% ... %} tag
_TAG_WITH_TOOLS = re.compile(r"\{[{%](?:(?![%}]\}).)*?\btools\b", re.S)


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template renders the request's ``tools`` (a heuristic).

    True when the parsed template reads a variable named ``tools`` it does not define itself (Jinja's
    undeclared variables). A template that Jinja cannot parse without Transformers' extensions (its
    ``{% generation %}`` tag) falls back to looking for the word ``tools`` inside a ``{{ }}`` or
    ``{% %}`` tag. Parsing costs a few milliseconds: call it once per template, not per request.
    """
    if not chat_template:
        return False
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return _TAG_WITH_TOOLS.search(chat_template) is not None
    return "tools" in meta.find_undeclared_variables(parsed)


def default_tools_system_block(tools: Sequence[FunctionTool]) -> str:
    """The system text that offers ``tools`` to a model whose template ignores them.

    Each function is one JSON line (name, description when given, parameters) inside
    ``<tools></tools>``; the model is asked to answer a call as ``<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>``, one block per call: what the ``hermes`` parser reads.
    """
    lines = []
    for tool in tools:
        entry: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            entry["description"] = tool.description
        entry["parameters"] = tool.parameters
        lines.append(json.dumps(entry, ensure_ascii=False))
    listing = "\n".join(lines)
    return (
        "# Tools\n\n"
        "You can call the functions listed below to help answer the user. Their signatures are JSON "
        "schemas, inside <tools></tools> tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, answer with its name and a JSON object of arguments inside "
        "<tool_call></tool_call> tags, one block per call:\n"
        f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{CALL_CLOSE}\n'
        "The results come back inside <tool_response></tool_response> tags."
    )


def render_call_block(name: str, arguments: dict[str, Any]) -> str:
    """One call as the text the default block asks for."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def messages_with_tools(
    messages: list[dict[str, Any]], tools: Sequence[FunctionTool] | None, supports_tools: bool
) -> list[dict[str, Any]]:
    """The conversation to hand to the chat template (new dicts; ``messages`` is left unchanged).

    ``messages`` are ``{"role", "content" (str or None), "name"?, "tool_calls"?, "tool_call_id"?}``.
    A template that supports tools gets each assistant ``tool_calls`` entry with its ``arguments``
    parsed to a dict (what Hugging Face templates expect); the tools themselves go to the template
    as its ``tools`` argument (``FunctionTool.to_openai``), which is the caller's part. Otherwise the
    default tools block is put before the first message's content when that is a system message (or
    in a new system message first), assistant calls are appended to their content as
    ``<tool_call>`` blocks, and ``tool`` messages keep their role with their content inside
    ``<tool_response></tool_response>``. Malformed ``tool_calls`` are a 400.
    """
    result = []
    for index, message in enumerate(messages):
        converted = dict(message)
        calls = _parse_tool_calls(index, message)
        converted.pop("tool_calls", None)
        if supports_tools:
            if calls:
                converted["tool_calls"] = [_template_call(*call) for call in calls]
        elif calls:
            blocks = "\n".join(render_call_block(name, arguments) for _, name, arguments in calls)
            content = _text(index, message)
            converted["content"] = f"{content}\n{blocks}" if content else blocks
        elif message.get("role") == "tool":
            converted["content"] = f"{RESPONSE_OPEN}\n{_text(index, message)}\n{RESPONSE_CLOSE}"
        result.append(converted)
    if tools and not supports_tools:
        block = default_tools_system_block(tools)
        if result and result[0].get("role") == "system":
            content = _text(0, result[0])
            result[0]["content"] = f"{block}\n\n{content}" if content else block
        else:
            result.insert(0, {"role": "system", "content": block})
    return result


def _template_call(call_id: str | None, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call: dict[str, Any] = {"id": call_id} if call_id is not None else {}
    call.update(type="function", function={"name": name, "arguments": arguments})
    return call


def _text(index: int, message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise bad_request(f"messages[{index}].content must be a string here.", f"messages[{index}].content")
    return content


def _parse_tool_calls(index: int, message: dict[str, Any]) -> list[tuple[str | None, str, dict[str, Any]]]:
    """``(id, name, arguments dict)`` of each entry of the message's ``tool_calls`` (400 if malformed)."""
    calls = message.get("tool_calls")
    if not calls:
        return []
    where = f"messages[{index}].tool_calls"
    if message.get("role") != "assistant":
        raise bad_request(f"{where}: only assistant messages may carry tool calls.", where)
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array.", where)
    parsed = []
    for position, call in enumerate(calls):
        at = f"{where}[{position}]"
        if not isinstance(call, dict):
            raise bad_request(f"{at} must be an object.", where)
        if call.get("type", "function") != "function":
            raise bad_request(f"{at}.type must be 'function'.", where)
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"{at}.id must be a string.", where)
        function = call.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{at}.function must be an object.", where)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{at}.function.name must be a non-empty string.", where)
        parsed.append((call_id, name, _arguments(function.get("arguments"), at, where)))
    return parsed


def _arguments(arguments: Any, at: str, where: str) -> dict[str, Any]:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_request(f"{at}.function.arguments is not valid JSON.", where) from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{at}.function.arguments must encode a JSON object.", where)
    return arguments
