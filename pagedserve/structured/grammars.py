"""Request specs -> xgrammar: the front end's check that a spec converts (a clear error before the
engine) and the engine's compile of the same spec with the same options (fixed separators, no free
whitespace, strict objects)."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured.schema_bounds import any_json_object_schema

DEFAULT_MAX_STRING_LENGTH = 256  # characters, for strings a schema leaves unbounded
JSON_OBJECT_MAX_STRING_LENGTH = 128  # characters of a string or key in "any JSON object"
_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarSpecError(ValueError):
    """A spec that does not convert or compile; the message names the problem."""


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose root is exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def grammar_source(params: StructuredOutputsParams) -> tuple[str, str]:
    """``("json" | "regex" | "ebnf", text)``: what xgrammar compiles for this spec."""
    kind = params.kind
    if kind == "json":
        return "json", params.json or ""
    if kind == "json_object":
        return "json", json.dumps(any_json_object_schema(JSON_OBJECT_MAX_STRING_LENGTH))
    if kind == "regex":
        return "regex", params.regex or ""
    if kind == "choice":
        return "ebnf", choice_ebnf(params.choice or ())
    return "ebnf", params.grammar or ""


def check_spec(params: StructuredOutputsParams) -> None:
    """Convert the spec to a grammar (no vocabulary needed) or raise GrammarSpecError."""
    import xgrammar as xgr

    source, text = grammar_source(params)
    try:
        if source == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        elif source == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarSpecError(f"invalid {_KIND_NAMES[params.kind]}: {clean_error(exc)}") from exc


def compile_spec(compiler: Any, params: StructuredOutputsParams) -> Any:
    """``params`` compiled against the compiler's vocabulary (the compiler caches per spec)."""
    source, text = grammar_source(params)
    if source == "json":
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if source == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    text = str(exc).strip()
    return _XGRAMMAR_LOCATION.sub("", text) or type(exc).__name__


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object spec",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}
