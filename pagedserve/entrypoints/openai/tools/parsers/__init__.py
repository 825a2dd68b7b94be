"""Parsers of tool calls from free model text (``tool_choice: "auto"``), by vLLM's
``--tool-call-parser`` names: get_tool_parser(name) in registry."""
