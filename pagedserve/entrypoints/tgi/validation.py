"""TGI's request checks, with TGI's own messages (422), and the plan they produce for the engine:
prompt tokens, SamplingParams, the reported seed and best_of."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pagedserve.entrypoints.input_checks import ModelLimits
from pagedserve.entrypoints.serving.errors import APIError
from pagedserve.entrypoints.serving.request_limits import MAX_STOP_STRING_CHARS
from pagedserve.entrypoints.serving.structured_outputs import StructuredOutputs
from pagedserve.entrypoints.serving.tokenization import PromptTokenizer
from pagedserve.entrypoints.tgi.protocol import (
    MAX_BEST_OF,
    MAX_STOP_SEQUENCES,
    MAX_TOP_N_TOKENS,
    GenerateParameters,
    GenerateRequest,
)
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

MAX_CLIENT_BATCH_SIZE = 4


def tgi_error(message: str, status: int = 422, error_type: str = "validation") -> APIError:
    return APIError(message, status, type=error_type)


@dataclass(slots=True)
class Plan:
    """A checked TGI request, ready for the engine."""

    token_ids: list[int]
    text: str
    params: SamplingParams
    seed: int | None
    best_of: int


class TGIPlanner:
    """Checks a TGI request against TGI's rules and the model's limits."""

    __slots__ = ("tokenizer", "limits", "structured")

    def __init__(self, tokenizer: PromptTokenizer, limits: ModelLimits, structured: StructuredOutputs) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.structured = structured

    @property
    def max_input_tokens(self) -> int:
        return self.limits.max_model_len - 1

    async def plan(self, request: GenerateRequest, stream: bool) -> Plan:
        p = request.parameters
        if not request.inputs:
            raise tgi_error("`inputs` cannot be empty")
        best_of = check_parameters(p, stream)
        self.limits.check_logprobs(p.top_n_tokens or 0, "top_n_tokens")
        constraint = await self._grammar(p.grammar)
        token_ids = await self.tokenizer.encode(request.inputs, True)
        token_ids = self._truncate(token_ids, p.truncate)
        if not token_ids:
            raise tgi_error("`inputs` cannot be empty")
        self.limits.check_token_ids(token_ids, "inputs")
        max_new_tokens = self._max_new_tokens(len(token_ids), p.max_new_tokens)
        sampling = (
            p.do_sample
            or any(v is not None for v in (p.top_k, p.top_p, p.typical_p))
            or (p.temperature is not None and p.temperature != 1.0)
        )
        seed = p.seed
        if sampling and seed is None:
            seed = random.getrandbits(63)
        try:
            params = SamplingParams(
                n=best_of,
                temperature=(p.temperature if p.temperature is not None else 1.0) if sampling else 0.0,
                top_k=p.top_k or 0,
                top_p=p.top_p if p.top_p is not None else 1.0,
                typical_p=p.typical_p if p.typical_p is not None else 1.0,
                repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
                frequency_penalty=p.frequency_penalty or 0.0,
                seed=seed if best_of == 1 else None,
                max_tokens=max_new_tokens,
                stop=list(p.stop),
                logprobs=p.top_n_tokens or 0,  # TGI reports every token's logprob
                prompt_logprobs=0 if p.decoder_input_details else None,
                structured_outputs=constraint,
            )
        except ValueError as exc:
            raise tgi_error(str(exc)) from exc
        return Plan(token_ids, request.inputs, params, seed if sampling else None, best_of)

    async def _grammar(self, grammar: object) -> StructuredOutputsParams | None:
        """TGI's ``grammar`` parameter as a checked constraint (422 with the reason when it is not valid)."""
        try:
            constraint = self.structured.from_tgi(grammar)
            if constraint is not None:
                await self.structured.check(constraint, "grammar")
        except APIError as exc:
            raise tgi_error(exc.message) from exc
        return constraint

    def _truncate(self, token_ids: list[int], truncate: int | None) -> list[int]:
        if truncate is None:
            return token_ids
        if truncate <= 0 or truncate > self.max_input_tokens:
            raise tgi_error(
                f"`truncate` must be strictly positive and less than {self.max_input_tokens}. Given: {truncate}"
            )
        return token_ids[-truncate:]

    def _max_new_tokens(self, num_input_tokens: int, requested: int | None) -> int:
        max_model_len = self.limits.max_model_len
        if num_input_tokens > self.max_input_tokens:
            raise tgi_error(f"`inputs` must have less than {self.max_input_tokens} tokens. Given: {num_input_tokens}")
        max_new_tokens = max_model_len - num_input_tokens if requested is None else requested
        if num_input_tokens + max_new_tokens > max_model_len:
            raise tgi_error(
                f"`inputs` tokens + `max_new_tokens` must be <= {max_model_len}. Given: "
                f"{num_input_tokens} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
            )
        return max_new_tokens


def check_parameters(p: GenerateParameters, stream: bool) -> int:
    """TGI's parameter rules, in TGI's order; returns best_of."""
    best_of = p.best_of if p.best_of is not None else 1
    if not 0 < best_of <= MAX_BEST_OF:
        raise tgi_error(f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {best_of}")
    sampling = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    if best_of > 1:
        if stream:
            raise tgi_error("`best_of` != 1 is not allowed for this endpoint")
        if p.seed is not None:
            raise tgi_error("`seed` must not be set when `best_of` > 1")
        if not sampling:
            raise tgi_error("you must use sampling when `best_of` is > 1")
    checks = [
        (p.temperature is not None and p.temperature <= 0, "`temperature` must be strictly positive"),
        (
            p.repetition_penalty is not None and p.repetition_penalty <= 0,
            "`repetition_penalty` must be strictly positive",
        ),
        (
            p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0,
            "`frequency_penalty` must be >= -2.0 and <= 2.0",
        ),
        (p.top_p is not None and not 0.0 < p.top_p < 1.0, "`top_p` must be > 0.0 and < 1.0"),
        (p.typical_p is not None and not 0.0 < p.typical_p < 1.0, "`typical_p` must be > 0.0 and < 1.0"),
        (p.top_k is not None and p.top_k <= 0, "`top_k` must be strictly positive"),
        (p.max_new_tokens is not None and p.max_new_tokens <= 0, "`max_new_tokens` must be strictly positive"),
        (
            len(p.stop) > MAX_STOP_SEQUENCES,
            f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop)}",
        ),
        (any(not s for s in p.stop), "`stop` sequences cannot be empty"),
        (
            any(len(s) > MAX_STOP_STRING_CHARS for s in p.stop),
            f"`stop` sequences may have at most {MAX_STOP_STRING_CHARS} characters",
        ),
        (
            p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= MAX_TOP_N_TOKENS,
            f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}",
        ),
        (p.seed is not None and not 0 <= p.seed < 2**64, "`seed` must be a non-negative 64-bit integer"),
        (p.watermark, "`watermark` is not supported by this server"),
        (p.adapter_id not in (None, ""), "`adapter_id` is not supported by this server"),
        (stream and p.decoder_input_details, "`decoder_input_details` == true is not supported when streaming tokens"),
    ]
    for failed, message in checks:
        if failed:
            raise tgi_error(message)
    return best_of
