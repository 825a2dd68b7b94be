"""Pydantic request models of TGI's /generate API (``{"inputs", "parameters", "stream"}``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="allow")

    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    return_full_text: bool | None = None
    stop: list[str] = Field(default_factory=list)
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = None
    top_n_tokens: int | None = None
    grammar: Any = None
    adapter_id: str | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False
