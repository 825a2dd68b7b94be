"""SSE framing: an event rendered from a template is the event encoded whole."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.serving.sse import TEXT_MARK, SSETemplate, SSETemplates, sse

TEXTS = [
    "",
    " token",
    'quote " and backslash \\ and slash /',
    "line\nbreak\ttab\rreturn",
    "control \x00 \x01 \x1f \x7f",
    "héllo 世界 🙂 \u2028 \u2029",
    "\ufffd",
    TEXT_MARK[1:],
]


def completion_chunk(text: str) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 2, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}],
    }


def chat_chunk(text: str) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": 'm "q" é',
        "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
    }


@pytest.mark.parametrize("make_chunk", [completion_chunk, chat_chunk])
@pytest.mark.parametrize("text", TEXTS)
def test_template_renders_the_same_event(make_chunk, text):
    template = SSETemplate(make_chunk(TEXT_MARK))
    event = template.render(text)
    assert event == sse(make_chunk(text))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: ") :]) == make_chunk(text)


def test_template_needs_the_mark_exactly_once():
    with pytest.raises(ValueError):
        SSETemplate(completion_chunk("no mark"))
    with pytest.raises(ValueError):
        SSETemplate({"a": TEXT_MARK, "b": TEXT_MARK})


def test_templates_are_built_once_per_choice_index():
    built = []

    def chunk_for(index: int, text: str) -> dict:
        chunk = completion_chunk(text)
        chunk["choices"][0]["index"] = index
        return chunk

    def make(index: int) -> dict:
        built.append(index)
        return chunk_for(index, TEXT_MARK)

    templates = SSETemplates(make)
    for index in (0, 1, 0, 1, 0):
        assert templates[index].render("x") == sse(chunk_for(index, "x"))
    assert built == [0, 1]
