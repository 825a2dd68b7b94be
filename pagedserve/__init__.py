"""pagedserve: a high-concurrency LLM inference server (paged KV cache, continuous batching, OpenAI/TGI API)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM


def __getattr__(name: str):  # lazy: importing the package does not load torch-heavy modules
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedserve.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLM":
        from pagedserve.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)


__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "FinishReason",
    "TokenLogprob",
    "__version__",
]
