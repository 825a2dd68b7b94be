"""Request fields -> StructuredOutputsParams, checked before the engine.

OpenAI's ``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` (json, regex,
choice, grammar, json_object) and its older ``guided_*`` fields, and TGI's ``parameters.grammar``
({"type": "json" | "regex", "value"}). Every spec is size- and depth-limited, refused when it uses a
JSON-schema keyword the grammar cannot enforce, and converted once (xgrammar, in a worker thread) so
that a spec that cannot compile is a 400 naming the problem; specs that passed are remembered.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pagedserve.entrypoints.serving.errors import bad_request
from pagedserve.sampling_params import STRUCTURED_KINDS, StructuredOutputsParams
from pagedserve.structured.grammars import JSON_OBJECT_MAX_STRING_LENGTH
from pagedserve.structured.schema_bounds import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    any_json_object_schema,
    bound_strings,
    schema_depth,
    unsupported_keyword,
)

# vLLM's structured_outputs options this server accepts and ignores: its output is always compact JSON
# with strict objects, and the backend is xgrammar
_IGNORED_OPTIONS = frozenset(
    {"disable_any_whitespace", "disable_additional_properties", "disable_fallback", "whitespace_pattern", "backend"}
)
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class StructuredOutputs:
    """Builds and checks the structured-output spec of requests (one per served model)."""

    def __init__(
        self, max_string_length: int, on_constrained: Callable[[str], None] | None = None, cache_size: int = 256
    ) -> None:
        self.on_constrained = on_constrained  # called with the spec's kind for every request that passed
        self.max_string_length = max_string_length  # for strings a schema leaves unbounded; 0 = no bound
        self._checked: OrderedDict[tuple[str, object], None] = OrderedDict()  # specs that converted (LRU)
        self._cache_size = cache_size

    # ----------------------------------------------------------------- OpenAI / vLLM fields
    def from_openai(self, request: Any) -> tuple[StructuredOutputsParams, str] | None:
        """The spec of an OpenAI completion or chat request and the field it came from (None:
        unconstrained); 400 on a bad one."""
        sources: list[tuple[str, StructuredOutputsParams]] = []
        fmt = request.response_format
        if fmt is not None:
            params = self._from_response_format(fmt)
            if params is not None:
                sources.append(("response_format", params))
        if request.structured_outputs is not None:
            sources.append(("structured_outputs", self._from_structured_outputs(request.structured_outputs)))
        for field, kind in _GUIDED_FIELDS.items():
            value = getattr(request, field, None)
            if value is not None:
                sources.append((field, self._spec(kind, value, field)))
        if len(sources) > 1:
            names = ", ".join(name for name, _ in sources)
            raise bad_request(f"Only one output constraint may be given per request; got {names}.", sources[1][0])
        return (sources[0][1], sources[0][0]) if sources else None

    def _from_response_format(self, fmt: Any) -> StructuredOutputsParams | None:
        if not isinstance(fmt, dict):
            raise bad_request("response_format must be an object with a `type`.", "response_format")
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return self._spec("json_object", True, "response_format")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise bad_request(
                    "response_format.json_schema must be an object with `name` and `schema`.",
                    "response_format.json_schema",
                )
            if "schema" not in spec:
                raise bad_request("response_format.json_schema.schema is required.", "response_format.json_schema")
            return self._spec("json", spec["schema"], "response_format.json_schema.schema")
        raise bad_request(
            f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'.",
            "response_format",
        )

    def _from_structured_outputs(self, value: Any) -> StructuredOutputsParams:
        param = "structured_outputs"
        if not isinstance(value, dict):
            raise bad_request("structured_outputs must be an object.", param)
        unknown = sorted(set(value) - set(STRUCTURED_KINDS) - _IGNORED_OPTIONS)
        if unknown:
            if "structural_tag" in unknown:
                raise bad_request("structured_outputs.structural_tag is not supported by this server.", param)
            raise bad_request(f"Unknown structured_outputs fields: {', '.join(unknown)}.", param)
        given = [key for key in STRUCTURED_KINDS if value.get(key) not in (None, False)]
        if len(given) != 1:
            raise bad_request(
                f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}; got {given or 'none'}.", param
            )
        key = given[0]
        return self._spec(key, value[key], f"{param}.{key}")

    # ----------------------------------------------------------------- TGI
    def from_tgi(self, grammar: Any) -> StructuredOutputsParams | None:
        """TGI's ``parameters.grammar``: ``{"type": "json", "value": schema}`` or ``{"type": "regex", "value"}``."""
        if grammar is None:
            return None
        if not isinstance(grammar, dict) or "type" not in grammar or "value" not in grammar:
            raise bad_request('grammar must be {"type": "json" | "regex", "value": ...}.', "grammar")
        kind = grammar["type"]
        if kind == "json":
            return self._spec("json", grammar["value"], "grammar.value")
        if kind == "regex":
            return self._spec("regex", grammar["value"], "grammar.value")
        raise bad_request(f"grammar type {kind!r} is not supported; use 'json' or 'regex'.", "grammar.type")

    # ----------------------------------------------------------------- specs
    def _spec(self, kind: str, value: Any, param: str) -> StructuredOutputsParams:
        if kind == "json":
            return StructuredOutputsParams(json=self.schema_text(value, param))
        if kind == "json_object":
            if value is not True:
                raise bad_request("json_object must be true.", param)
            schema = any_json_object_schema(min(self.max_string_length, JSON_OBJECT_MAX_STRING_LENGTH) or 0)
            return StructuredOutputsParams(json=json.dumps(schema))
        if kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise bad_request(f"{param} must be a non-empty string.", param)
            if len(value) > MAX_SPEC_CHARS:
                raise bad_request(f"{param} is too long: {len(value)} characters, at most {MAX_SPEC_CHARS}.", param)
            return StructuredOutputsParams(**{kind: value})
        # choice
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings.", param)
        if len(value) > MAX_CHOICES:
            raise bad_request(f"{param} has {len(value)} choices, at most {MAX_CHOICES}.", param)
        if max(len(c) for c in value) > MAX_CHOICE_CHARS:
            raise bad_request(f"{param}: a choice is longer than {MAX_CHOICE_CHARS} characters.", param)
        return StructuredOutputsParams(choice=tuple(dict.fromkeys(value)))

    def schema_text(self, value: Any, param: str) -> str:
        if isinstance(value, str):
            if len(value) > MAX_SPEC_CHARS:
                raise bad_request(f"{param} is too long: {len(value)} characters, at most {MAX_SPEC_CHARS}.", param)
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"{param} is not valid JSON: {exc}.", param) from exc
        if isinstance(value, bool):
            value = {} if value else None
        if not isinstance(value, dict):
            raise bad_request(f"{param} must be a JSON schema object.", param)
        if schema_depth(value) > MAX_SCHEMA_DEPTH:
            raise bad_request(f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep.", param)
        found = unsupported_keyword(value)
        if found is not None:
            keyword, where = found
            raise bad_request(
                f"{param}: the JSON-schema keyword `{keyword}` (at {where}) is not supported by structured outputs.",
                param,
            )
        text = json.dumps(bound_strings(value, self.max_string_length), ensure_ascii=False)
        if len(text) > MAX_SPEC_CHARS:
            raise bad_request(f"{param} is too large: {len(text)} characters, at most {MAX_SPEC_CHARS}.", param)
        return text

    async def parse_and_check(self, request: Any) -> StructuredOutputsParams | None:
        """``from_openai`` then ``check``: the checked spec of an OpenAI request, or None."""
        found = self.from_openai(request)
        if found is None:
            return None
        await self.check(*found)
        return found[0]

    async def check(self, params: StructuredOutputsParams, param: str, kind: str | None = None) -> None:
        """400 unless the spec converts to a grammar (in a worker thread; remembered when it does).
        ``kind`` is the label it is counted under (default: the spec's kind)."""
        key = params.key
        if key in self._checked:
            self._checked.move_to_end(key)
            self._count(kind or params.kind)
            return
        from pagedserve.structured.grammars import GrammarSpecError, check_spec

        try:
            await asyncio.to_thread(check_spec, params)
        except GrammarSpecError as exc:
            raise bad_request(f"{param}: {exc}", param) from exc
        self._checked[key] = None
        if len(self._checked) > self._cache_size:
            self._checked.popitem(last=False)
        self._count(kind or params.kind)

    def _count(self, kind: str) -> None:
        if self.on_constrained is not None:
            self.on_constrained(kind)
