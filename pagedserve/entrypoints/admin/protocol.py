"""The admin API's request body (pydantic: a bad field is a 400 in OpenAI's shape)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LoadModelRequest(BaseModel):
    """``POST /admin/models``: serve ``model`` (a .gguf file or a Hugging Face directory) as ``name``; a name
    already served is swapped to the new engine. Unset fields take the server's engine flags."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    model: str = Field(min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    quantization: str | None = None
    replicas: int | None = Field(default=None, ge=1)
    engine: Literal["paged", "hf"] | None = None
