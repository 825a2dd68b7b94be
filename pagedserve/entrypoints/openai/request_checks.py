"""The OpenAI routes' first checks, in this order: the served model (404), a live engine (503), then
fields this server cannot honour (400)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.protocol import MAX_STOP_SEQUENCES, SamplingFields
from pagedserve.entrypoints.serving.admission import check_engine_alive
from pagedserve.entrypoints.serving.errors import APIError, bad_request
from pagedserve.entrypoints.serving.request_limits import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRING_CHARS

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedModels:
    """The names clients may ask for; the first is the one answered with."""

    names: tuple[str, ...]

    @property
    def default(self) -> str:
        return self.names[0]

    def resolve(self, model: str | None) -> str:
        """The name to answer with; 404 if the client asked for a model we do not serve."""
        if model is None or model == "" or model in self.names:
            return self.names[0]
        raise model_not_found(model)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")


def check_generation_request(request: SamplingFields, models: ServedModels, engine: AsyncLLM) -> str:
    """What every generation route checks first; returns the model name to answer with."""
    model_name = models.resolve(request.model)
    check_engine_alive(engine)
    reject_unsupported(request)
    return model_name


def reject_unsupported(request: SamplingFields) -> None:
    if request.model_extra:
        logger.debug("The following fields were present in the request but ignored: %s", sorted(request.model_extra))
    if request.best_of is not None and request.best_of != 1:
        raise bad_request("best_of is not supported; use n (and logprobs) instead.", "best_of")
    if request.use_beam_search:
        raise bad_request("Beam search is not supported.", "use_beam_search")
    if request.logits_processors is not None:
        raise bad_request("logits_processors is not supported by this server.", "logits_processors")
    if request.stream_options is not None and not request.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    stops = request.stop
    if isinstance(stops, list) and len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"At most {MAX_STOP_SEQUENCES} stop sequences are supported.", "stop")
    for stop in [stops] if isinstance(stops, str) else stops or ():
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"Each stop sequence may have at most {MAX_STOP_STRING_CHARS} characters.", "stop")
    if request.logit_bias is not None and len(request.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries.", "logit_bias")
