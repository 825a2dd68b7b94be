"""Tool parsers: hermes and llama3_json extraction, the registry, and streaming that adds up to
exactly what extraction finds, for every split of the text."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.entrypoints.openai.tools.parsers.base import ExtractedToolCalls, StreamDelta, ToolCallDelta, ToolParser
from pagedserve.entrypoints.openai.tools.parsers.hermes import HermesToolParser
from pagedserve.entrypoints.openai.tools.parsers.llama3_json import Llama3JsonToolParser
from pagedserve.entrypoints.openai.tools.parsers.registry import get_tool_parser, tool_parser_names

HERMES = HermesToolParser()
LLAMA = Llama3JsonToolParser()


def calls_of(extracted: ExtractedToolCalls) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in extracted.calls]


# ------------------------------------------------------------------------------------------ hermes
def test_hermes_single_call() -> None:
    out = HERMES.extract('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
    assert out.content is None and out.tools_called
    assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", '{"city": "Zürich"}')]
    assert out.calls[0].id.startswith("call_")


def test_hermes_text_before_between_and_after() -> None:
    text = (
        'Let me check.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call> {"name": "b", "arguments": "{\\"y\\": [2]}"} </tool_call>\n\nDone.'
    )
    out = HERMES.extract(text)
    assert calls_of(out) == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert out.content == "Let me check.Done."
    assert len({c.id for c in out.calls}) == 2


def test_hermes_no_call_is_plain_content() -> None:
    for text in ("Hello there", "  spaced  \n", "a < b and <tool> is not <tool_call", ""):
        out = HERMES.extract(text)
        assert out.calls == [] and out.content == (text or None)


def test_hermes_missing_arguments_mean_none() -> None:
    assert calls_of(HERMES.extract('<tool_call>{"name": "ping"}</tool_call>')) == [("ping", {})]
    assert calls_of(HERMES.extract('<tool_call>{"name": "p", "parameters": {"k": 1}}</tool_call>')) == [("p", {"k": 1})]


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>',  # broken JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["a"]</tool_call>',
        '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
    ],
)
def test_hermes_invalid_block_stays_content(block: str) -> None:
    text = 'ok <tool_call>{"name": "good", "arguments": {}}</tool_call> ' + block
    out = HERMES.extract(text)
    assert calls_of(out) == [("good", {})]
    assert out.content == "ok" + block


def test_hermes_unterminated_block_stays_content() -> None:
    text = 'Sure <tool_call>{"name": "a", "arguments": {"x": 1}}'
    out = HERMES.extract(text)
    assert out.calls == [] and out.content == text


# ------------------------------------------------------------------------------------- llama3_json
def test_llama3_single_and_tagged() -> None:
    for prefix in ("", "<|python_tag|>", "\n <|python_tag|> "):
        out = LLAMA.extract(prefix + '{"name": "get_weather", "parameters": {"city": "Paris"}}')
        assert out.content is None
        assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", '{"city": "Paris"}')]


def test_llama3_several_calls() -> None:
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}};\n{"name": "c"}'
    assert calls_of(LLAMA.extract(text)) == [("a", {"x": 1}), ("b", {}), ("c", {})]
    assert calls_of(LLAMA.extract('{"name": "a", "parameters": {}};')) == [("a", {})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        'Calling {"name": "a", "parameters": {}}',
        '{"name": "a", "parameters": {}} and then text',
        '{"name": "a", "parameters": {}}; nope',
        '{"name": "a", "parameters": {}};;',
        '{"name": "a", "parameters": {"x": 1}',  # cut off
        '{"answer": 42}',
        '{"name": "a", "parameters": []}',
        "<|python_tag|>print(1)",
        "<|python_tag|>",
        "   ",
        "",
    ],
)
def test_llama3_other_text_is_content(text: str) -> None:
    out = LLAMA.extract(text)
    assert out.calls == [] and out.content == (text or None)


# ---------------------------------------------------------------------------------------- registry
def test_registry() -> None:
    assert tool_parser_names() == ("hermes", "llama3_json")
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    assert isinstance(get_tool_parser("llama3_json"), Llama3JsonToolParser)
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")


# --------------------------------------------------------------------------------------- streaming
def test_delta_shapes() -> None:
    first = ToolCallDelta(0, "call_x", "f", "")
    assert first.to_openai() == {
        "index": 0,
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(0, None, None, '{"a"').to_openai() == {"index": 0, "function": {"arguments": '{"a"'}}
    assert not StreamDelta() and StreamDelta("x") and StreamDelta(None, (first,))


def test_hermes_holds_back_a_possible_tag() -> None:
    stream = HERMES.streaming()
    assert stream.feed("Hi <tool").content == "Hi"
    assert stream.feed("box> ").content == " <toolbox>"  # not a tag: released; trailing space held
    assert stream.feed("<tool_call>").content is None
    delta = stream.feed('{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert delta.content is None
    (call,) = delta.tool_calls
    assert (call.index, call.name, call.arguments) == (0, "f", '{"a": 1}') and call.id.startswith("call_")
    assert stream.num_calls == 1
    assert not stream.finish()


def test_llama3_streams_plain_text_at_once() -> None:
    stream = LLAMA.streaming()
    assert stream.feed("  ").content is None
    assert stream.feed("Hello").content == "  Hello"
    assert stream.feed(" world").content == " world"
    assert not stream.finish()


def test_llama3_releases_content_once_json_cannot_be_calls() -> None:
    stream = LLAMA.streaming()
    assert not stream.feed('{"name": "a", "parameters": {}')
    assert stream.feed("}").content is None  # a call so far: held
    assert stream.feed(" ok").content == '{"name": "a", "parameters": {}} ok'
    assert stream.num_calls == 0


SAMPLES = {
    HERMES: [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>',
        'I will look.\n\n<tool_call>{"name": "a", "arguments": {"q": "x</tool_call>y"}}</tool_call>',
        'A <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"k\\": 2}"}'
        "</tool_call> trailing <tool_",
        'Text < tool_call> <tool_call>{"bad json</tool_call> then <tool_call>{"name": "c", "arguments": {"v": [1, 2]}}',
        "Just a reply, with <b>markup</b> and <tool> and a final space ",
        '<tool_call><tool_call>{"name": "n", "arguments": {}}</tool_call></tool_call>',
        'x <tool_call>{"bad</tool_call> <tool_call>{"name": "c", "arguments": {"v": [1, 2]}}</tool_call>',
    ],
    LLAMA: [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "東京"}}',
        ' {"name": "a", "parameters": {"x": {"y": "}"}}}; {"name": "b", "arguments": {}}\n',
        '{"name": "a", "parameters": {}} but then prose {"name": "b"}',
        "Plain answer } with braces {",
        '{"name": "a", "parameters": {"x": 1',
        "<|python_tag|>not json",
    ],
}


def stream_result(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and (name, arguments) calls a stream of ``pieces`` adds up to, checking the delta shapes."""
    stream = parser.streaming()
    content = ""
    calls: dict[int, list[str]] = {}
    for delta in [*(stream.feed(piece) for piece in pieces), stream.finish()]:
        content += delta.content or ""
        for piece in delta.tool_calls:
            if piece.index in calls:
                assert piece.id is None and piece.name is None
                calls[piece.index][1] += piece.arguments
            else:
                assert piece.index == len(calls) and piece.id and piece.name
                calls[piece.index] = [piece.name, piece.arguments]
    assert stream.num_calls == len(calls)
    return content, [(name, args) for name, args in calls.values()]


def splits(text: str, rng: random.Random) -> list[list[str]]:
    every_char = list(text)
    pairs = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    randoms = []
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        randoms.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return [every_char, *pairs, *randoms]


@pytest.mark.parametrize(("parser", "text"), [(parser, text) for parser, texts in SAMPLES.items() for text in texts])
def test_streaming_equals_extraction(parser: ToolParser, text: str) -> None:
    expected = parser.extract(text)
    want = (expected.content or "", [(c.name, c.arguments) for c in expected.calls])
    rng = random.Random(text)
    for pieces in splits(text, rng):
        assert stream_result(parser, pieces) == want, pieces


def test_sample_expectations() -> None:
    """What the streaming samples hold, so the equivalence above is not trivially empty."""
    hermes = [HERMES.extract(text) for text in SAMPLES[HERMES]]
    assert [len(out.calls) for out in hermes] == [1, 0, 2, 0, 0, 0, 1]
    assert hermes[1].content == SAMPLES[HERMES][1]  # the first close tag ends the block: broken JSON
    assert hermes[2].content == "Atrailing <tool_"
    assert hermes[3].content == SAMPLES[HERMES][3]  # a broken block, then an unterminated one
    assert hermes[5].content == SAMPLES[HERMES][5]  # the first close tag ends a block that is not JSON
    assert hermes[6].content == 'x <tool_call>{"bad</tool_call>'
    llama = [LLAMA.extract(text) for text in SAMPLES[LLAMA]]
    assert [len(out.calls) for out in llama] == [1, 2, 0, 0, 0, 0]
    assert json.loads(llama[1].calls[0].arguments) == {"x": {"y": "}"}}
