"""The ``hermes`` format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any
number, with text around them.

A block whose JSON is not a call, and an unterminated block at the end, stay content. The
whitespace next to a valid block is dropped from the content; other text is kept as written. A call
is released whole when its block closes.
"""

from __future__ import annotations

import json

from pagedserve.entrypoints.openai.tools.calls import call_fields
from pagedserve.entrypoints.openai.tools.parsers.base import DeltaBuilder, StreamDelta, StreamingToolParser, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def held_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def parse_block(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a block's body, or None when it is not a call."""
    try:
        return call_fields(json.loads(body))
    except ValueError:
        return None


class _TrimmedContent:
    """Content with the whitespace next to valid blocks dropped: trailing whitespace is held until
    text follows it (kept) or a valid block does (dropped)."""

    __slots__ = ("_pending", "_after_block")

    def __init__(self) -> None:
        self._pending = ""
        self._after_block = False

    def add(self, text: str) -> str:
        if self._after_block:
            text = text.lstrip()
            if not text:
                return ""
            self._after_block = False
        text = self._pending + text
        body = text.rstrip()
        self._pending = text[len(body) :]
        return body

    def block(self) -> None:
        self._pending = ""
        self._after_block = True

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text


class HermesStream(StreamingToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # not yet released: a possible tag start, or an open block's body
        self._in_block = False
        self._searched = 0  # where an open block's body may still hold the close tag
        self._content = _TrimmedContent()

    def feed(self, text: str) -> StreamDelta:
        out = DeltaBuilder(self)
        self._buffer += text
        while self._step(out):
            pass
        return out.build()

    def _step(self, out: DeltaBuilder) -> bool:
        """Consume what can be decided now; True when it should run again."""
        if not self._in_block:
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = held_prefix_length(self._buffer, OPEN)
                out.content(self._content.add(self._buffer[: len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            out.content(self._content.add(self._buffer[:start]))
            self._buffer = self._buffer[start + len(OPEN) :]
            self._in_block = True
            return True
        end = self._buffer.find(CLOSE, self._searched)
        if end < 0:
            self._searched = max(0, len(self._buffer) - len(CLOSE) + 1)  # a long body is searched once
            return False
        self._searched = 0
        body = self._buffer[:end]
        self._buffer = self._buffer[end + len(CLOSE) :]
        self._in_block = False
        call = parse_block(body)
        if call is None:
            out.content(self._content.add(OPEN + body + CLOSE))
        else:
            self._content.block()
            out.call(*call)
        return True

    def finish(self) -> StreamDelta:
        out = DeltaBuilder(self)
        rest = OPEN + self._buffer if self._in_block else self._buffer
        self._buffer, self._in_block, self._searched = "", False, 0
        out.content(self._content.add(rest))
        out.content(self._content.flush())
        return out.build()


class HermesToolParser(ToolParser):
    name = "hermes"

    def streaming(self) -> HermesStream:
        return HermesStream()
