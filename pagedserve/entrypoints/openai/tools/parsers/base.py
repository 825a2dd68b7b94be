"""The tool parser interface: ToolParser (one per format, stateless) reads the calls of a complete
output; its StreamingToolParser (one per request and sample) turns text deltas into content and
tool-call deltas, holding back text that may still become part of a call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedserve.entrypoints.openai.tools.calls import ToolCall, new_tool_call_id


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A complete output: the text outside the calls (None when there is none) and the calls."""

    content: str | None
    calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call ``index``: its first piece has ``id`` and ``name``; ``arguments`` pieces of one
    call concatenate to its final arguments JSON string."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The ``delta.tool_calls`` entry of a chat completion chunk."""
        delta: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            delta["id"] = self.id
            delta["type"] = "function"
        function: dict[str, Any] = {"name": self.name} if self.name is not None else {}
        function["arguments"] = self.arguments
        delta["function"] = function
        return delta


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one ``feed`` (or ``finish``) releases: content text, call pieces, or both (or nothing)."""

    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content) or bool(self.tool_calls)


class DeltaBuilder:
    """Collects the content and call pieces of one step, numbering calls across the stream."""

    __slots__ = ("_content", "_calls", "_stream")

    def __init__(self, stream: StreamingToolParser) -> None:
        self._stream = stream
        self._content: list[str] = []
        self._calls: list[ToolCallDelta] = []

    def content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def call(self, name: str, arguments: str) -> None:
        """A whole call in one piece."""
        self._calls.append(ToolCallDelta(self._stream.next_index(), new_tool_call_id(), name, arguments))

    def build(self) -> StreamDelta:
        return StreamDelta("".join(self._content) or None, tuple(self._calls))


class StreamingToolParser(ABC):
    """One output's stream: ``feed`` each text delta, then ``finish`` once at its end."""

    def __init__(self) -> None:
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        """The calls released so far (finish_reason ``tool_calls`` when non-zero at the end)."""
        return self._num_calls

    def next_index(self) -> int:
        """The index of a new call."""
        index = self._num_calls
        self._num_calls += 1
        return index

    @abstractmethod
    def feed(self, text: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta:
        """Everything still held back (the output ended)."""


class ToolParser(ABC):
    """A tool-call format; ``extract`` runs the streaming parser over the whole text, so the two agree."""

    name: ClassVar[str]

    @abstractmethod
    def streaming(self) -> StreamingToolParser: ...

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self.streaming()
        return merge_deltas([stream.feed(text), stream.finish()])


def merge_deltas(deltas: list[StreamDelta]) -> ExtractedToolCalls:
    """The content and the calls that a sequence of stream deltas adds up to."""
    content = "".join(delta.content or "" for delta in deltas)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in calls:
                calls[piece.index] = [piece.id or new_tool_call_id(), piece.name or "", ""]
            calls[piece.index][2] += piece.arguments
    return ExtractedToolCalls(
        content or None, [ToolCall(call_id, name, args) for call_id, name, args in calls.values()]
    )
