"""The tool parsers by vLLM's ``--tool-call-parser`` names."""

from __future__ import annotations

from pagedserve.entrypoints.openai.tools.parsers.base import ToolParser
from pagedserve.entrypoints.openai.tools.parsers.hermes import HermesToolParser
from pagedserve.entrypoints.openai.tools.parsers.llama3_json import Llama3JsonToolParser


def _parser_types() -> dict[str, type[ToolParser]]:
    return {parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)}


def tool_parser_names() -> tuple[str, ...]:
    return tuple(sorted(_parser_types()))


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name`` (ValueError listing the valid names)."""
    parser = _parser_types().get(name)
    if parser is None:
        raise ValueError(f"Unknown tool call parser {name!r}; valid names: {', '.join(tool_parser_names())}.")
    return parser()
