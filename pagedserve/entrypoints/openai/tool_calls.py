"""ToolCalling: a chat request's ``tools`` / ``tool_choice`` as the chat handler uses them.

``required`` and named choices are forced through structured outputs (a JSON schema built from the
tools' parameter schemas) and the constrained output is turned into ``message.tool_calls``;
``auto`` (with ``--enable-auto-tool-choice --tool-call-parser NAME``) parses calls out of the
model's free text, streams included; ``none`` leaves the tools out of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.entrypoints.openai.tools.calls import ToolCall, new_tool_call_id
from pagedserve.entrypoints.openai.tools.constraint import (
    call_from_named_output,
    calls_from_required_output,
    named_call_schema,
    required_calls_schema,
)
from pagedserve.entrypoints.openai.tools.parsers.base import StreamDelta, StreamingToolParser, ToolCallDelta, ToolParser
from pagedserve.entrypoints.openai.tools.parsers.registry import get_tool_parser
from pagedserve.entrypoints.openai.tools.spec import FunctionTool, ToolRequest, parse_tool_request
from pagedserve.entrypoints.serving.errors import bad_request


@dataclass(frozen=True, slots=True)
class ToolCallingOptions:
    """The server's tool-calling flags."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    max_parallel_calls: int = 0  # most calls of a forced "required" answer; 0: the request's number of tools

    @classmethod
    def for_template(
        cls, enable_auto: bool, parser: str | None, max_parallel_calls: int, template_supports_tools: bool
    ) -> ToolCallingOptions:
        """The flags as served: when the model's template ignores tools, the prompt's default system
        block asks for hermes-style calls, so ``auto`` parses hermes without any flag."""
        if parser is None and not template_supports_tools:
            return cls(True, "hermes", max_parallel_calls)
        return cls(enable_auto, parser, max_parallel_calls)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools are handled: its mode, the tools put in the prompt, and for ``auto`` the
    parser of calls in the text."""

    request: ToolRequest
    parser: ToolParser | None
    max_parallel_calls: int = 0

    @property
    def mode(self) -> str:
        return self.request.choice.mode

    @property
    def prompt_tools(self) -> tuple[FunctionTool, ...] | None:
        return None if self.mode == "none" else self.request.tools

    def constraint_schema(self) -> dict[str, Any] | None:
        if self.mode == "required":
            return required_calls_schema(self.request, self.max_parallel_calls)
        if self.mode == "named":
            return named_call_schema(self.request)
        return None

    def calls_of(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and calls of a complete output; a forced output that does not parse (cut by
        max_tokens) stays content."""
        try:
            if self.mode == "required":
                return None, calls_from_required_output(text)
            if self.mode == "named":
                return None, [call_from_named_output(self.request.choice.name or "", text)]
        except ValueError:
            return text, []
        if self.parser is not None:
            extracted = self.parser.extract(text)
            return extracted.content, list(extracted.calls)
        return text, []

    def finish_reason(self, finish: str | None, num_calls: int) -> str | None:
        """OpenAI's: ``tool_calls`` when calls came back (``stop`` for a named choice, as OpenAI does)."""
        if num_calls and finish == "stop" and self.mode != "named":
            return "tool_calls"
        return finish

    def streamer(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's stream: a named choice's output is its call's arguments, sent as they come; a
    ``required`` output is held and sent as call deltas at the end; ``auto`` feeds the parser and
    sends content and call pieces as they are known."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._held: list[str] = []
        self._named_id: str | None = None
        self._parser: StreamingToolParser | None = (
            plan.parser.streaming() if plan.mode == "auto" and plan.parser is not None else None
        )

    def feed(self, text: str) -> StreamDelta:
        if self.plan.mode == "named":
            return self._named_piece(text)
        if self.plan.mode == "required":
            self._held.append(text)
            return StreamDelta()
        if self._parser is None:
            return StreamDelta(content=text or None)
        return self._parser.feed(text)

    def _named_piece(self, text: str) -> StreamDelta:
        if not text:
            return StreamDelta()
        if self._named_id is not None:
            return StreamDelta(tool_calls=(ToolCallDelta(0, None, None, text),))
        self._named_id = new_tool_call_id()
        self.num_calls = 1
        return StreamDelta(tool_calls=(ToolCallDelta(0, self._named_id, self.plan.request.choice.name, text),))

    def finish(self) -> StreamDelta:
        if self.plan.mode == "named":
            return StreamDelta()
        if self._parser is not None:
            delta = self._parser.finish()
            self.num_calls = self._parser.num_calls
            return delta
        if self.plan.mode != "required":
            return StreamDelta()
        content, calls = self.plan.calls_of("".join(self._held))
        self.num_calls = len(calls)
        pieces = tuple(ToolCallDelta(i, call.id, call.name, call.arguments) for i, call in enumerate(calls))
        return StreamDelta(content=content, tool_calls=pieces)


def plan_tools(request: Any, options: ToolCallingOptions) -> ToolPlan | None:
    """The tool plan of a chat request (None without tools); 400 on bad tools or an unavailable choice."""
    if request.functions or request.function_call not in (None, "none"):
        raise bad_request("The deprecated `functions` / `function_call` are not supported; use `tools`.", "functions")
    tool_request = parse_tool_request(request.tools, request.tool_choice, request.parallel_tool_calls)
    if tool_request is None:
        return None
    parser = None
    if tool_request.choice.mode == "auto":
        if not options.enable_auto_tool_choice or not options.tool_call_parser:
            raise bad_request(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                '--tool-call-parser; use tool_choice "required" or a named function.',
                "tool_choice",
            )
        parser = get_tool_parser(options.tool_call_parser)
    return ToolPlan(tool_request, parser, options.max_parallel_calls)
