"""GenerationParts: what the OpenAI generation handlers (completions, chat) are built from, built once per server."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.prompts import OpenAIPrompts, PreparedPrompt
from pagedserve.entrypoints.openai.protocol import SamplingFields
from pagedserve.entrypoints.openai.request_checks import ServedModels
from pagedserve.entrypoints.openai.sampling import SamplingBuilder
from pagedserve.entrypoints.serving.admission import AdmissionControl
from pagedserve.entrypoints.serving.logprobs import TokenTexts
from pagedserve.entrypoints.serving.structured_outputs import StructuredOutputs
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerationParts:
    """The engine, the served names, prompt preparation, sampling-params building, output constraints,
    admission, token texts and the per-request timeout (seconds; None for no limit)."""

    engine: AsyncLLM
    models: ServedModels
    prompts: OpenAIPrompts
    sampling: SamplingBuilder
    admission: AdmissionControl
    texts: TokenTexts
    request_timeout: float | None
    structured: StructuredOutputs

    def generate(
        self, prompt: PreparedPrompt, params: SamplingParams, request_id: str, request: SamplingFields
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's stream for one prepared prompt, with the request's priority and cache salt."""
        return self.engine.generate(
            prompt.token_ids,
            params,
            request_id,
            prompt=prompt.text,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
