"""TGIServing: TGI's /generate and /generate_stream on AsyncLLM, with TGI's validation messages,
``details`` (tokens, prefill, top tokens, best_of sequences) and error shapes (422 / 424 / 429)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from starlette.responses import Response

from pagedserve.engine.core_client import EngineDeadError
from pagedserve.entrypoints.openai.errors import APIError, json_response
from pagedserve.entrypoints.openai.serving_engine import OpenAIServing, PreparedPrompt, clamp_logprob, random_id
from pagedserve.entrypoints.openai.sse import SSEResponse
from pagedserve.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from pagedserve.sampling_params import SamplingParams
from pagedserve.entrypoints.tgi.protocol import GenerateParameters, GenerateRequest

logger = logging.getLogger(__name__)

MAX_BEST_OF = 2
MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5
MAX_CLIENT_BATCH_SIZE = 4


def tgi_error(message: str, status: int = 422, error_type: str = "validation") -> APIError:
    return APIError(message, status, type=error_type)


@dataclass(slots=True)
class _Plan:
    prompt: PreparedPrompt
    params: SamplingParams
    seed: int | None
    best_of: int


class TGIServing(OpenAIServing):
    """Serves TGI's generate API; the engine and limits are shared with the OpenAI routes."""

    @property
    def max_input_tokens(self) -> int:
        return self.max_model_len - 1

    def info(self, version: str, dtype: str | None = None) -> dict:
        return {
            "model_id": self.config.model_name,
            "model_sha": None,
            "model_dtype": dtype,
            "model_device_type": "cpu",
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": self.admission.capacity,
            "max_best_of": MAX_BEST_OF,
            "max_stop_sequences": MAX_STOP_SEQUENCES,
            "max_input_tokens": self.max_input_tokens,
            "max_total_tokens": self.max_model_len,
            "validation_workers": 1,
            "max_client_batch_size": MAX_CLIENT_BATCH_SIZE,
            "router": "pagedserve",
            "version": version,
            "sha": None,
            "docker_label": None,
        }

    async def generate_response(self, request: GenerateRequest, wrap_in_list: bool = False) -> Response:
        plan = await self._plan(request, stream=False)
        self.admission.acquire()
        try:
            result = await self._collect(plan)
        finally:
            self.admission.release()
        body = self._generate_body(request, plan, result)
        headers = {"x-prompt-tokens": str(len(plan.prompt.token_ids))}
        return json_response([body] if wrap_in_list else body, headers=headers)

    async def generate_stream_response(self, request: GenerateRequest) -> Response:
        plan = await self._plan(request, stream=True)
        self.admission.acquire()
        return SSEResponse(self._stream(request, plan), on_close=self.admission.release)

    # ----------------------------------------------------------------- validation (TGI's messages)
    async def _plan(self, request: GenerateRequest, stream: bool) -> _Plan:
        self.check_engine_alive()
        p = request.parameters
        if not request.inputs:
            raise tgi_error("`inputs` cannot be empty")
        best_of = self._check_parameters(p, stream)
        token_ids = await self.tokenize(request.inputs, True)
        if p.truncate is not None:
            if p.truncate <= 0 or p.truncate > self.max_input_tokens:
                raise tgi_error(f"`truncate` must be strictly positive and less than {self.max_input_tokens}. "
                                f"Given: {p.truncate}")
            token_ids = token_ids[-p.truncate:]
        if not token_ids:
            raise tgi_error("`inputs` cannot be empty")
        if len(token_ids) > self.max_input_tokens:
            raise tgi_error(f"`inputs` must have less than {self.max_input_tokens} tokens. Given: {len(token_ids)}")
        max_new_tokens = p.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = self.max_model_len - len(token_ids)
        if len(token_ids) + max_new_tokens > self.max_model_len:
            raise tgi_error(f"`inputs` tokens + `max_new_tokens` must be <= {self.max_model_len}. Given: "
                            f"{len(token_ids)} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
        sampling = p.do_sample or any(
            v is not None for v in (p.top_k, p.top_p, p.typical_p)
        ) or (p.temperature is not None and p.temperature != 1.0)
        seed = p.seed
        if sampling and seed is None:
            seed = random.getrandbits(63)
        try:
            params = SamplingParams(
                n=best_of,
                temperature=(p.temperature if p.temperature is not None else 1.0) if sampling else 0.0,
                top_k=p.top_k or 0,
                top_p=p.top_p if p.top_p is not None else 1.0,
                repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
                frequency_penalty=p.frequency_penalty or 0.0,
                seed=seed if best_of == 1 else None,
                max_tokens=max_new_tokens,
                stop=list(p.stop),
                logprobs=p.top_n_tokens or 0,  # TGI reports every token's logprob
                prompt_logprobs=0 if p.decoder_input_details else None,
            )
        except ValueError as exc:
            raise tgi_error(str(exc)) from exc
        return _Plan(PreparedPrompt(token_ids, request.inputs), params, seed if sampling else None, best_of)

    @staticmethod
    def _check_parameters(p: GenerateParameters, stream: bool) -> int:
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
            (p.repetition_penalty is not None and p.repetition_penalty <= 0,
             "`repetition_penalty` must be strictly positive"),
            (p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0,
             "`frequency_penalty` must be >= -2.0 and <= 2.0"),
            (p.top_p is not None and not 0.0 < p.top_p < 1.0, "`top_p` must be > 0.0 and < 1.0"),
            (p.typical_p is not None, "`typical_p` is not supported by this server"),
            (p.top_k is not None and p.top_k <= 0, "`top_k` must be strictly positive"),
            (p.max_new_tokens is not None and p.max_new_tokens <= 0, "`max_new_tokens` must be strictly positive"),
            (len(p.stop) > MAX_STOP_SEQUENCES,
             f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop)}"),
            (any(not s for s in p.stop), "`stop` sequences cannot be empty"),
            (p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= MAX_TOP_N_TOKENS,
             f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}"),
            (p.seed is not None and not 0 <= p.seed < 2**64, "`seed` must be a non-negative 64-bit integer"),
            (p.watermark, "`watermark` is not supported by this server"),
            (p.grammar is not None, "`grammar` is not supported by this server"),
            (p.adapter_id not in (None, ""), "`adapter_id` is not supported by this server"),
            (stream and p.decoder_input_details,
             "`decoder_input_details` == true is not supported when streaming tokens"),
        ]
        for failed, message in checks:
            if failed:
                raise tgi_error(message)
        return best_of

    # ----------------------------------------------------------------- running
    async def _collect(self, plan: _Plan) -> RequestOutput:
        try:
            return await self.collect(self.generate(plan.prompt, plan.params, random_id("tgi")))
        except APIError as exc:
            if exc.status == 500:
                raise tgi_error(exc.message, 424, "generation") from exc
            raise

    def _generate_body(self, request: GenerateRequest, plan: _Plan, result: RequestOutput) -> dict:
        p = request.parameters
        outputs = sorted(result.outputs, key=lambda c: c.index)
        if plan.best_of > 1:
            outputs.sort(key=lambda c: -sum(lp.logprob for lp in (c.logprobs or [])))
        best = outputs[0]
        prefix = request.inputs if p.return_full_text else ""
        body: dict = {"generated_text": prefix + best.text}
        if p.details or p.decoder_input_details:
            details = self._sequence_details(best, plan, result, p)
            if plan.best_of > 1:
                details["best_of_sequences"] = [
                    {"generated_text": prefix + other.text, **self._sequence_details(other, plan, result, p)}
                    for other in outputs[1:]
                ]
            body["details"] = details
        return body

    def _sequence_details(self, completion: CompletionOutput, plan: _Plan, result: RequestOutput,
                          p: GenerateParameters) -> dict:
        logprobs = completion.logprobs or []
        tokens = [self._token_json(t, logprobs[i] if i < len(logprobs) else None)
                  for i, t in enumerate(completion.token_ids)]
        details: dict = {
            "finish_reason": tgi_finish_reason(completion),
            "generated_tokens": len(completion.token_ids),
            "seed": plan.seed,
            "prefill": self._prefill(plan.prompt.token_ids, result.prompt_logprobs) if p.decoder_input_details else [],
            "tokens": tokens,
        }
        if p.top_n_tokens:
            details["top_tokens"] = [self._top_tokens(lp, p.top_n_tokens) for lp in logprobs]
        return details

    def _prefill(self, token_ids: list[int], logprobs: list[TokenLogprob | None] | None) -> list[dict]:
        logprobs = logprobs or []
        return [
            {"id": t, "text": self.token_str(t),
             "logprob": clamp_logprob(logprobs[i].logprob) if i < len(logprobs) and logprobs[i] else None}
            for i, t in enumerate(token_ids)
        ]

    def _token_json(self, token_id: int, logprob: TokenLogprob | None, text: str | None = None) -> dict:
        return {
            "id": token_id,
            "text": self.token_str(token_id) if text is None else text,
            "logprob": clamp_logprob(logprob.logprob) if logprob is not None else None,
            "special": self.is_special(token_id),
        }

    def _top_tokens(self, logprob: TokenLogprob | None, count: int) -> list[dict]:
        if logprob is None:
            return []
        return [{"id": t, "text": self.token_str(t), "logprob": clamp_logprob(lp), "special": self.is_special(t)}
                for t, lp in logprob.top[:count]]

    async def _stream(self, request: GenerateRequest, plan: _Plan) -> AsyncGenerator[str, None]:
        p = request.parameters
        index = 0
        text_parts: list[str] = []
        try:
            async with asyncio.timeout(self.config.request_timeout):
                async for output in self.generate(plan.prompt, plan.params, random_id("tgi")):
                    completion = output.outputs[0]
                    text_parts.append(completion.text)
                    for event in self._token_events(completion, p, index, output.finished,
                                                    "".join(text_parts), len(plan.prompt.token_ids), plan.seed,
                                                    request.inputs if p.return_full_text else ""):
                        index += 1
                        yield event
        except TimeoutError:
            yield _tgi_event({"error": f"Request timed out after {self.config.request_timeout} s",
                              "error_type": "timeout"})
        except (EngineDeadError, ValueError) as exc:
            yield _tgi_event({"error": f"Request failed during generation: {exc}", "error_type": "generation"})
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-stream
            logger.exception("stream failed")
            yield _tgi_event({"error": f"Incomplete generation: {exc!r}", "error_type": "incomplete_generation"})

    def _token_events(self, completion: CompletionOutput, p: GenerateParameters, index: int, finished: bool,
                      generated_text: str, input_length: int, seed: int | None, prefix: str) -> list[str]:
        """One event per token; the delta text goes on the last non-special token of the delta."""
        ids = completion.token_ids
        logprobs = completion.logprobs or []
        last_plain = max((i for i, t in enumerate(ids) if not self.is_special(t)), default=-1)
        if last_plain == -1 and completion.text:
            last_plain = len(ids) - 1  # held-back text released by a special token (e.g. EOS)
        events = []
        for i, token_id in enumerate(ids):
            if i == last_plain:
                text = completion.text
            else:
                text = self.token_str(token_id) if self.is_special(token_id) else ""
            logprob = logprobs[i] if i < len(logprobs) else None
            event: dict = {
                "index": index + i,
                "token": self._token_json(token_id, logprob, text),
                "top_tokens": self._top_tokens(logprob, p.top_n_tokens) if p.top_n_tokens else None,
                "generated_text": None,
                "details": None,
            }
            if finished and i == len(ids) - 1:
                event["generated_text"] = prefix + generated_text
                event["details"] = {
                    "finish_reason": tgi_finish_reason(completion),
                    "generated_tokens": index + len(ids),
                    "seed": seed,
                    "input_length": input_length,
                }
            events.append(_tgi_event(event))
        return events


def tgi_finish_reason(completion: CompletionOutput) -> str:
    if completion.finish_reason is FinishReason.LENGTH:
        return "length"
    if isinstance(completion.stop_reason, str):
        return "stop_sequence"
    return "eos_token"


def _tgi_event(data: dict) -> str:
    return "data:" + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"
