"""ModelServing: one served model's HTTP layer (its spec, AsyncLLM, tokenizer, limits, admission control
and OpenAI / TGI handlers), built by ``build_model_serving`` around an engine core that is not started
yet; and its lease count, which keeps it alive until every response that resolved it has ended."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.config import ModelSpec
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.entrypoints.input_checks import ModelLimits
from pagedserve.entrypoints.openai.chat_template import ChatTemplate
from pagedserve.entrypoints.openai.handler_parts import GenerationParts
from pagedserve.entrypoints.openai.prompts import OpenAIPrompts
from pagedserve.entrypoints.openai.request_checks import ServedModels
from pagedserve.entrypoints.openai.sampling import SamplingBuilder, SamplingDefaults
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from pagedserve.entrypoints.openai.tool_calls import ToolCallingOptions
from pagedserve.entrypoints.server_config import ServerConfig
from pagedserve.entrypoints.serving.admission import AdmissionControl
from pagedserve.entrypoints.serving.logprobs import TokenTexts
from pagedserve.entrypoints.serving.structured_outputs import StructuredOutputs
from pagedserve.entrypoints.serving.tokenization import PromptTokenizer
from pagedserve.entrypoints.tgi.details import TGIDetails
from pagedserve.entrypoints.tgi.serving import TGIServing
from pagedserve.entrypoints.tgi.validation import TGIPlanner
from pagedserve.metrics import Metrics, StatsLogLine

logger = logging.getLogger("pagedserve.server")

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
DRAIN_POLL_S = 0.05


@dataclass(slots=True, eq=False)
class ModelServing:
    """One engine behind a served name, with everything that serves it. ``names[0]`` is the name it answers
    with; ``state`` is loading / ready / draining / failed. ``leases`` counts the requests that resolved it
    and whose responses have not ended (taken by ``ModelRegistry.acquire``, given back by ``release``)."""

    spec: ModelSpec
    names: tuple[str, ...]
    engine: AsyncLLM
    tokenizer: Any  # a HF fast tokenizer
    limits: ModelLimits
    admission: AdmissionControl
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    tgi: TGIServing
    stats_line: StatsLogLine
    model_path: str  # what /v1/models reports as the cards' root
    created: int  # unix time it was built, the cards' `created`
    state: str = LOADING
    leases: int = 0

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def core(self) -> EngineCoreClient:
        return self.engine.core

    @property
    def idle(self) -> bool:
        """No response holds it and its engine runs nothing."""
        return self.leases == 0 and self.engine.num_unfinished_requests == 0

    def release(self) -> None:
        """A response that resolved this serving has ended."""
        self.leases -= 1

    async def start(self) -> None:
        """Warm the engine up (a real forward pass), then start it; the state stays ``loading``."""
        await self.engine.warmup()
        await self.engine.start()

    async def drain(self, timeout: float | None) -> None:
        """Wait until idle, or ``timeout`` seconds (None: no limit); what is left is aborted by ``shutdown``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.idle and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(DRAIN_POLL_S)
        if not self.idle:
            logger.warning(
                "model %r: drain timeout; aborting %d unfinished requests",
                self.name,
                self.engine.num_unfinished_requests,
            )

    async def shutdown(self) -> None:
        """Stop the engine (aborting what it still runs)."""
        await self.engine.shutdown()


def build_model_serving(
    config: ServerConfig,
    spec: ModelSpec,
    names: tuple[str, ...],
    core: EngineCoreClient,
    tokenizer: Any,
    metrics: Metrics,
    on_dead: Callable[[ModelServing, BaseException], None] | None = None,
) -> ModelServing:
    """The HTTP layer of ``spec`` over ``core`` (not started: ``ModelServing.start`` warms it up and starts it).

    Its per-request metrics and log line carry ``names[0]``; ``on_dead(serving, error)`` runs if its engine dies.
    """
    info = core.model_info
    name = names[0]
    models = ServedModels(names)
    request_metrics = metrics.for_model(name)
    stats_line = StatsLogLine(core.get_stats, label=name if len(config.models) > 1 else "")
    engine = AsyncLLM(core, tokenizer, stat_observers=[request_metrics.record, stats_line.record])
    admission = AdmissionControl(
        config.admission_capacity(spec),
        config.http.retry_after_s,
        on_reject=lambda reason: metrics.record_rejected(reason, name),
    )
    limits = ModelLimits(info.max_model_len, info.vocab_size, spec.engine_config.max_logprobs)
    prompt_tokenizer = PromptTokenizer(tokenizer)
    template = ChatTemplate(tokenizer)
    texts = TokenTexts(tokenizer)
    timeout = config.http.request_timeout
    prompts = OpenAIPrompts(prompt_tokenizer, template, limits)
    sampling = SamplingBuilder(limits, SamplingDefaults.from_generation_config(info.generation_config))
    structured = StructuredOutputs(
        config.http.structured_max_string_length, on_constrained=lambda kind: metrics.record_structured(kind, name)
    )
    generation = GenerationParts(engine, models, prompts, sampling, admission, texts, timeout, structured)
    serving = ModelServing(
        spec=spec,
        names=names,
        engine=engine,
        tokenizer=tokenizer,
        limits=limits,
        admission=admission,
        completion=OpenAIServingCompletion(generation),
        chat=OpenAIServingChat(
            generation,
            ToolCallingOptions.for_template(
                config.http.enable_auto_tool_choice,
                config.http.tool_call_parser,
                config.http.max_parallel_tool_calls,
                template.supports_tools,
            ),
        ),
        tokenization=OpenAIServingTokenization(
            models=models, tokenizer=prompt_tokenizer, template=template, limits=limits
        ),
        tgi=TGIServing(
            engine=engine,
            planner=TGIPlanner(prompt_tokenizer, limits, structured),
            details=TGIDetails(texts),
            admission=admission,
            request_timeout=timeout,
            model_name=name,
            model_dtype=info.dtype,
        ),
        stats_line=stats_line,
        model_path=spec.engine_config.model.model or info.model_name,
        created=int(time.time()),
    )
    if on_dead is not None:
        engine.on_dead(lambda error: on_dead(serving, error))
    return serving
