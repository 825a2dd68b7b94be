"""Pydantic request models of the OpenAI-compatible API (with vLLM's extra sampling fields).

Unknown fields are accepted and ignored (as vLLM does); fields we cannot honour are rejected
by the serving classes with a 400. Responses are built as plain dicts (cheaper to serialize).

The ranges a field must fall in are checked by ``SamplingParams`` and the serving classes (with their
own messages); ``documented`` writes them into the JSON schema only, so that /openapi.json (and the
fuzzer driven by it) knows them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.entrypoints.serving.request_limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_MESSAGES,
    MAX_STOP_STRING_CHARS,
)
from pagedserve.entrypoints.serving.strict_numbers import integral_floats_as_ints
from pagedserve.sampling_params import MAX_N

MAX_STOP_SEQUENCES = 16
_INT64 = 2**63


def documented(default: Any = None, **schema: Any) -> Any:
    """A field whose JSON-schema constraints are documented, not enforced by pydantic."""
    return Field(default=default, json_schema_extra=schema)


ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]
CHAT_ROLES = frozenset(ChatRole.__args__)  # type: ignore[attr-defined]


def _non_null(*fields: str) -> Any:
    """A model's json_schema_extra: ``fields`` are required and not null in the schema (the handler checks
    them with its own message)."""

    def extra(schema: dict[str, Any]) -> None:
        schema["required"] = sorted({*schema.get("required", ()), *fields})
        for name in fields:
            prop = schema["properties"][name]
            prop["anyOf"] = [branch for branch in prop.get("anyOf", ()) if branch.get("type") != "null"]
            prop.pop("default", None)

    return extra


_REFUSED_TEMPLATE: Any = documented(
    None, type="null", description="Refused: the server never runs a template sent with a request."
)
_DOCUMENT = {"type": "object", "properties": {"title": {"type": "string"}, "text": {"type": "string"}}}


class OpenAIBaseModel(BaseModel):
    # strict: no coercion of "5" to 5 or of true to 1 (a boolean is never a token id), as OpenAI's API;
    # an integral float is an integer (serving/strict_numbers.py)
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        return integral_floats_as_ints(cls, data)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    @field_validator("n", mode="after")
    @classmethod
    def _null_n_is_one(cls, n: int | None) -> int:
        return 1 if n is None else n

    model: str | None = None
    n: int | None = documented(1, minimum=1, maximum=MAX_N, description="null: 1, as OpenAI's API")
    best_of: int | None = documented(None, minimum=1, maximum=1, description="Only 1; use n instead.")
    temperature: float | None = documented(None, minimum=0)
    top_p: float | None = documented(None, exclusiveMinimum=0, maximum=1)
    frequency_penalty: float | None = documented(0.0, minimum=-2, maximum=2)
    presence_penalty: float | None = documented(0.0, minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = documented(
        None,
        maxProperties=MAX_LOGIT_BIAS_ENTRIES,
        propertyNames={"pattern": "^[0-9]{1,9}$"},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
        description="Token id (in the vocabulary) -> bias added to its logit.",
    )
    seed: int | None = documented(None, minimum=-_INT64, maximum=_INT64 - 1)
    stop: str | list[str] | None = documented(
        None, description=f"Up to {MAX_STOP_SEQUENCES} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters."
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = documented(None, description="Only with stream: true.")
    user: str | None = None
    # vLLM extras
    top_k: int | None = documented(None, minimum=-1)
    min_p: float | None = documented(None, minimum=0, maximum=1)
    repetition_penalty: float | None = documented(None, exclusiveMinimum=0)
    length_penalty: float = 1.0
    use_beam_search: bool = documented(False, const=False, description="Not supported: only false.")
    stop_token_ids: list[int] | None = documented(None, items={"type": "integer", "minimum": 0})
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = documented(0, minimum=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = documented(None, minimum=1)
    prompt_logprobs: int | None = documented(None, minimum=0, description="Not with stream: true.")
    priority: int = 0
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="Prefix-cache isolation: cached prompt blocks are shared only among requests with the same "
        "salt (give each tenant its own).",
    )
    # output constraints (entrypoints/serving/structured_outputs.py checks them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # accepted only to be refused with a clear message
    logits_processors: Any = documented(None, type="null", description="Not supported: only null.")


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    # required (the schema says so) but checked by the handler, with vLLM's message
    model_config = ConfigDict(json_schema_extra=_non_null("prompt"))

    prompt: list[int] | list[list[int]] | str | list[str] | None = documented(
        None,
        anyOf=[
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            {
                "type": "array",
                "minItems": 1,
                "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            },
        ],
        description="Required: text, token ids (in the vocabulary), or a list of either (one completion each).",
    )
    max_tokens: int | None = documented(16, minimum=1)
    echo: bool | None = False
    logprobs: int | None = documented(None, minimum=0)
    suffix: str | None = None
    add_special_tokens: bool = True


class TextContentPart(OpenAIBaseModel):
    type: str = documented(..., enum=["text"])
    text: str | None = documented(None, type="string", description="Required.")


class ChatMessage(OpenAIBaseModel):
    role: str = documented(..., enum=sorted(CHAT_ROLES))
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES, json_schema_extra={"minItems": 1})
    max_tokens: int | None = documented(None, minimum=1, description="Deprecated in favour of max_completion_tokens.")
    max_completion_tokens: int | None = documented(None, minimum=1)
    logprobs: bool | None = False
    top_logprobs: int | None = documented(None, minimum=0)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = _REFUSED_TEMPLATE
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = documented(None, items=_DOCUMENT)


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES, json_schema_extra={"minItems": 1})
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = _REFUSED_TEMPLATE
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
