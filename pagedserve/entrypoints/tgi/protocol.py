"""Pydantic request models of TGI's /generate API (``{"inputs", "parameters", "stream"}``).

Ranges are checked by ``tgi.validation`` (TGI's own messages, 422); the schema only documents them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedserve.entrypoints.serving.strict_numbers import integral_floats_as_ints

MAX_BEST_OF = 2
MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5


def _doc(default: Any = None, **schema: Any) -> Any:
    """A field whose JSON-schema constraints are documented here and checked by ``tgi.validation``."""
    return Field(default=default, json_schema_extra=schema)


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # and integral floats as ints

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        return integral_floats_as_ints(cls, data)

    best_of: int | None = _doc(None, minimum=1, maximum=MAX_BEST_OF, description="> 1 needs sampling and no seed")
    temperature: float | None = _doc(None, exclusiveMinimum=0)
    repetition_penalty: float | None = _doc(None, exclusiveMinimum=0)
    frequency_penalty: float | None = _doc(None, minimum=-2, maximum=2)
    top_k: int | None = _doc(None, minimum=1)
    top_p: float | None = _doc(None, exclusiveMinimum=0, exclusiveMaximum=1)
    typical_p: float | None = _doc(None, exclusiveMinimum=0, exclusiveMaximum=1)
    do_sample: bool = False
    max_new_tokens: int | None = _doc(None, minimum=1)
    return_full_text: bool | None = None
    stop: list[str] = Field(
        default_factory=list,
        json_schema_extra={"maxItems": MAX_STOP_SEQUENCES, "items": {"type": "string", "minLength": 1}},
    )
    truncate: int | None = _doc(None, minimum=1)
    watermark: bool = _doc(False, const=False, description="Not supported: only false.")
    details: bool = False
    decoder_input_details: bool = _doc(False, description="Not with /generate_stream.")
    seed: int | None = _doc(None, minimum=0, maximum=2**64 - 1)
    top_n_tokens: int | None = _doc(None, minimum=0, maximum=MAX_TOP_N_TOKENS)
    grammar: Any = _doc(
        None,
        anyOf=[
            {"type": "null"},
            {
                "type": "object",
                "properties": {"type": {"enum": ["json", "json_schema"]}, "value": {"type": "object"}},
                "required": ["type", "value"],
            },
            {
                "type": "object",
                "properties": {"type": {"const": "regex"}, "value": {"type": "string", "minLength": 1}},
                "required": ["type", "value"],
            },
        ],
        description='{"type": "json", "value": <JSON schema>} or {"type": "regex", "value": <pattern>}',
    )
    adapter_id: str | None = _doc(None, enum=[None, ""], description="Not supported: only null or empty.")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # and integral floats as ints

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        return integral_floats_as_ints(cls, data)

    inputs: str = Field(json_schema_extra={"minLength": 1})
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False
