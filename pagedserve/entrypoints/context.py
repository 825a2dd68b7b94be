"""ServerContext: everything the HTTP layer runs on (config, engine, tokenizer, admission, metrics,
server state, model names, the handlers), built once by ``build_context``; routes reach it with
``get_context`` (it is the only thing on ``app.state``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.entrypoints.input_checks import ModelLimits
from pagedserve.entrypoints.middleware import ServerState
from pagedserve.entrypoints.openai.chat_template import ChatTemplate
from pagedserve.entrypoints.openai.handler_parts import GenerationParts
from pagedserve.entrypoints.openai.prompts import OpenAIPrompts
from pagedserve.entrypoints.openai.request_checks import ServedModels
from pagedserve.entrypoints.openai.sampling import SamplingBuilder, SamplingDefaults
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from pagedserve.entrypoints.server_config import ServerConfig
from pagedserve.entrypoints.serving.admission import AdmissionControl
from pagedserve.entrypoints.serving.logprobs import TokenTexts
from pagedserve.entrypoints.serving.tokenization import PromptTokenizer
from pagedserve.entrypoints.tgi.details import TGIDetails
from pagedserve.entrypoints.tgi.serving import TGIServing
from pagedserve.entrypoints.tgi.validation import TGIPlanner
from pagedserve.metrics import Metrics, StatsLogLine


@dataclass(slots=True)
class ServerContext:
    """One server's HTTP layer. ``on_ready`` / ``on_fatal`` are the launcher's hooks into start-up."""

    config: ServerConfig
    engine: AsyncLLM
    tokenizer: Any  # a HF fast tokenizer
    admission: AdmissionControl
    metrics: Metrics
    stats_line: StatsLogLine
    state: ServerState
    models: ServedModels
    model_root: str  # what /v1/models reports as the cards' root
    created: int  # unix time of start-up, the cards' `created`
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    tgi: TGIServing
    background_tasks: set[asyncio.Task] = field(default_factory=set)
    on_ready: Callable[[], None] | None = None
    on_fatal: Callable[[str], None] | None = None


def get_context(request: Request) -> ServerContext:
    """The context of the app serving ``request``."""
    return request.app.state.context


def build_context(config: ServerConfig, core: EngineCoreClient, tokenizer: Any) -> ServerContext:
    """The HTTP layer over an engine core that is not started yet (the app's lifespan starts it)."""
    info = core.model_info
    models = ServedModels(config.served_model_names or (info.model_name,))
    metrics = Metrics(models.default, core.get_stats, info.block_size, info.num_kv_blocks)
    stats_line = StatsLogLine(core.get_stats)
    engine = AsyncLLM(core, tokenizer, stat_observers=[metrics.record, stats_line.record])
    admission = AdmissionControl(
        config.admission_capacity, config.http.retry_after_s, on_reject=metrics.record_rejected
    )
    limits = ModelLimits(info.max_model_len, info.vocab_size, config.engine_config.max_logprobs)
    prompt_tokenizer = PromptTokenizer(tokenizer)
    template = ChatTemplate(tokenizer)
    texts = TokenTexts(tokenizer)
    timeout = config.http.request_timeout
    prompts = OpenAIPrompts(prompt_tokenizer, template, limits)
    sampling = SamplingBuilder(limits, SamplingDefaults.from_generation_config(info.generation_config))
    generation = GenerationParts(engine, models, prompts, sampling, admission, texts, timeout)
    return ServerContext(
        config=config,
        engine=engine,
        tokenizer=tokenizer,
        admission=admission,
        metrics=metrics,
        stats_line=stats_line,
        state=ServerState(),
        models=models,
        model_root=config.engine_config.model.model or info.model_name,
        created=int(time.time()),
        completion=OpenAIServingCompletion(generation),
        chat=OpenAIServingChat(generation),
        tokenization=OpenAIServingTokenization(
            models=models, tokenizer=prompt_tokenizer, template=template, limits=limits
        ),
        tgi=TGIServing(
            engine=engine,
            planner=TGIPlanner(prompt_tokenizer, limits),
            details=TGIDetails(texts),
            admission=admission,
            request_timeout=timeout,
            model_name=models.default,
            model_dtype=info.dtype,
        ),
    )
