"""The ``llama3_json`` format (Llama 3.x JSON tool calling): the whole output, after optional
whitespace and ``<|python_tag|>``, is one call object ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), or several separated by ``;``. Anything else is all content, as written.

Streaming holds an output back from its first ``{`` until it either can no longer be calls (then it
streams as content) or ends (then its calls are released, whole).
"""

from __future__ import annotations

import enum
import json

from pagedserve.entrypoints.openai.tools.calls import call_fields
from pagedserve.entrypoints.openai.tools.parsers.base import DeltaBuilder, StreamDelta, StreamingToolParser, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Scan(enum.Enum):
    COMPLETE = "complete"  # every object so far is a call (more may follow)
    PARTIAL = "partial"  # a call object is still open (or none has begun)
    INVALID = "invalid"  # no continuation can make this calls


def _after_tag(text: str) -> str:
    text = text.lstrip()
    return text[len(PYTHON_TAG) :] if text.startswith(PYTHON_TAG) else text


def scan_calls(text: str) -> tuple[list[tuple[str, str]], Scan]:
    """The ``(name, arguments JSON)`` calls that begin ``text``, and what the rest of it is."""
    body = _after_tag(text)
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    expect_object = True
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            return calls, (Scan.COMPLETE if calls else Scan.PARTIAL)
        if not expect_object:
            if body[pos] != ";":
                return calls, Scan.INVALID
            pos += 1
            expect_object = True
            continue
        if body[pos] != "{":
            return calls, Scan.INVALID
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return calls, Scan.PARTIAL  # unfinished, or broken: decided when the output ends
        call = call_fields(obj)
        if call is None:
            return calls, Scan.INVALID
        calls.append(call)
        expect_object = False


class _Mode(enum.Enum):
    UNDECIDED = 0  # only whitespace and (part of) the python tag so far
    CALLS = 1  # began with "{": held back
    TEXT = 2  # plain content


class Llama3JsonStream(StreamingToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._mode = _Mode.UNDECIDED
        self._scanned = Scan.PARTIAL

    def feed(self, text: str) -> StreamDelta:
        out = DeltaBuilder(self)
        if self._mode is _Mode.TEXT:
            out.content(text)
            return out.build()
        self._buffer += text
        if self._mode is _Mode.UNDECIDED:
            self._mode = self._decide()
        if self._mode is _Mode.CALLS and ("}" in text or self._scanned is Scan.COMPLETE):
            # an object may have closed, or text follows closed ones: can this still be calls?
            self._scanned = scan_calls(self._buffer)[1]
            if self._scanned is Scan.INVALID:
                self._mode = _Mode.TEXT
        if self._mode is _Mode.TEXT:
            out.content(self._buffer)
            self._buffer = ""
        return out.build()

    def _decide(self) -> _Mode:
        start = self._buffer.lstrip()
        if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
            return _Mode.UNDECIDED
        body = _after_tag(start).lstrip()
        if not body:
            return _Mode.UNDECIDED
        return _Mode.CALLS if body[0] == "{" else _Mode.TEXT

    def finish(self) -> StreamDelta:
        out = DeltaBuilder(self)
        if self._mode is not _Mode.TEXT:
            calls, state = scan_calls(self._buffer)
            if calls and state is Scan.COMPLETE:
                for name, arguments in calls:
                    out.call(name, arguments)
            else:
                out.content(self._buffer)
        self._buffer = ""
        self._mode = _Mode.TEXT
        return out.build()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def streaming(self) -> Llama3JsonStream:
        return Llama3JsonStream()
