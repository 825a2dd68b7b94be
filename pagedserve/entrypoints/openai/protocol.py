"""Pydantic request models of the OpenAI-compatible API (with vLLM's extra sampling fields).

Unknown fields are accepted and ignored (as vLLM does); fields we cannot honour are rejected
by the serving classes with a 400. Responses are built as plain dicts (cheaper to serialize).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    use_beam_search: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    # output constraints (entrypoints/serving/structured_outputs.py checks them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # accepted only to be refused with a clear message
    logits_processors: Any = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, description="Deprecated in favour of max_completion_tokens.")
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]
CHAT_ROLES = frozenset(ChatRole.__args__)  # type: ignore[attr-defined]
