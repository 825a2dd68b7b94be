"""OpenAIServingCompletion: POST /v1/completions (one or several prompts, streaming or not)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from starlette.responses import Response

from pagedserve.engine.core_client import EngineDeadError
from pagedserve.entrypoints.openai.formatting import completion_logprobs, prompt_logprobs_json, usage
from pagedserve.entrypoints.openai.handler_parts import GenerationParts
from pagedserve.entrypoints.openai.prompts import PreparedPrompt
from pagedserve.entrypoints.openai.protocol import CompletionRequest
from pagedserve.entrypoints.openai.request_checks import check_generation_request
from pagedserve.entrypoints.serving.admission import collect, engine_failed, random_id, timeout_error
from pagedserve.entrypoints.serving.errors import APIError, bad_request, json_response
from pagedserve.entrypoints.serving.sse import (
    SSE_DONE,
    TEXT_MARK,
    SSEResponse,
    SSETemplates,
    merge_async_iterators,
    sse,
)
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class OpenAIServingCompletion:
    """Checks a completion request, runs its prompts and answers with one body or an SSE stream."""

    def __init__(self, parts: GenerationParts) -> None:
        self.parts = parts

    async def create_completion(self, request: CompletionRequest) -> Response:
        model_name = check_generation_request(request, self.parts.models, self.parts.engine)
        if request.suffix:
            raise bad_request("suffix is not currently supported.", "suffix")
        self.parts.sampling.check_logprobs(request.logprobs, "logprobs")
        self.parts.sampling.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        constraint = await self.parts.structured.parse_and_check(request)
        prompts = await self.parts.prompts.completion_prompts(request)
        params = [self._params_for(request, prompt, constraint) for prompt in prompts]
        request_id = random_id("cmpl")
        self.parts.admission.acquire(len(prompts))
        if request.stream:
            stream = self._stream(request, request_id, model_name, prompts, params)
            return SSEResponse(stream, on_close=lambda: self.parts.admission.release(len(prompts)))
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(
                        collect(self.parts.generate(p, sp, f"{request_id}-{i}", request), self.parts.request_timeout)
                    )
                    for i, (p, sp) in enumerate(zip(prompts, params))
                ]
        except* APIError as group_error:
            raise group_error.exceptions[0] from None
        finally:
            self.parts.admission.release(len(prompts))
        results = [task.result() for task in tasks]
        return json_response(self._response(request, request_id, model_name, prompts, results))

    def _params_for(
        self, request: CompletionRequest, prompt: PreparedPrompt, constraint: StructuredOutputsParams | None
    ) -> SamplingParams:
        explicit = "max_tokens" in request.model_fields_set
        requested = request.max_tokens if explicit else None
        max_tokens = self.parts.sampling.resolve_max_tokens(len(prompt.token_ids), requested, None if explicit else 16)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        return self.parts.sampling.build(request, max_tokens, request.logprobs, prompt_logprobs, constraint)

    # ----------------------------------------------------------------- non-streaming
    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[PreparedPrompt],
        results: list[RequestOutput],
    ) -> dict:
        choices = []
        num_prompt_tokens = num_generated = 0
        for prompt_index, (prompt, result) in enumerate(zip(prompts, results)):
            num_prompt_tokens += len(prompt.token_ids)
            for completion in sorted(result.outputs, key=lambda c: c.index):
                num_generated += len(completion.token_ids)
                choices.append(self._choice(request, prompt, result, completion, prompt_index * request.n))
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(num_prompt_tokens, num_generated, sum(r.num_cached_tokens for r in results)),
        }

    def _choice(
        self,
        request: CompletionRequest,
        prompt: PreparedPrompt,
        result: RequestOutput,
        completion: CompletionOutput,
        index_base: int,
    ) -> dict:
        text = completion.text
        token_ids = completion.token_ids
        logprobs = completion.logprobs
        if request.echo:
            text = (prompt.text or "") + text
            if request.logprobs is not None:
                prompt_lps = result.prompt_logprobs or [None] * len(prompt.token_ids)
                token_ids = prompt.token_ids + token_ids
                logprobs = list(prompt_lps) + list(logprobs or [])
        choice = {
            "index": index_base + completion.index,
            "text": text,
            "logprobs": completion_logprobs(self.parts.texts, token_ids, logprobs, request.logprobs, 0)
            if request.logprobs is not None
            else None,
            "finish_reason": completion.finish_reason.value if completion.finish_reason else None,
            "stop_reason": completion.stop_reason,
        }
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(self.parts.texts, prompt.token_ids, result.prompt_logprobs)
        return choice

    # ----------------------------------------------------------------- streaming
    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[PreparedPrompt],
        params: list[SamplingParams],
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        n = request.n
        texts = self.parts.texts
        streams = [
            self.parts.generate(p, sp, f"{request_id}-{i}", request) for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        num_generated = [0] * len(prompts)
        num_cached = [0] * len(prompts)
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = include_usage and bool(request.stream_options.continuous_usage_stats)
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}

        def chunk(index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason: object) -> dict:
            return {
                **head,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                        "stop_reason": stop_reason,
                    }
                ],
            }

        plain_events = SSETemplates(lambda index: chunk(index, TEXT_MARK, None, None, None))  # per choice: text only

        try:
            async with asyncio.timeout(self.parts.request_timeout):
                async for prompt_index, output in merge_async_iterators(*streams):
                    num_cached[prompt_index] = output.num_cached_tokens
                    for completion in output.outputs:
                        num_generated[prompt_index] += len(completion.token_ids)
                        index = prompt_index * n + completion.index
                        text = completion.text
                        if request.echo and index not in echoed:
                            echoed.add(index)
                            text = (prompts[prompt_index].text or "") + text
                        wants_logprobs = request.logprobs is not None and completion.token_ids
                        if not text and completion.finish_reason is None and not wants_logprobs:
                            continue
                        logprobs = None
                        if request.logprobs is not None:
                            logprobs = completion_logprobs(
                                texts,
                                completion.token_ids,
                                completion.logprobs,
                                request.logprobs,
                                offsets.get(index, 0),
                            )
                        offsets[index] = offsets.get(index, 0) + len(completion.text)
                        finish = completion.finish_reason
                        if logprobs is None and finish is None and completion.stop_reason is None and not continuous:
                            yield plain_events[index].render(text)
                            continue
                        event = chunk(index, text, logprobs, finish.value if finish else None, completion.stop_reason)
                        if continuous:
                            event["usage"] = usage(num_prompt_tokens, sum(num_generated), None)
                        yield sse(event)
            if include_usage:
                yield sse(
                    {**head, "choices": [], "usage": usage(num_prompt_tokens, sum(num_generated), sum(num_cached))}
                )
        except TimeoutError:
            yield sse(timeout_error(self.parts.request_timeout).openai_body())
        except EngineDeadError as exc:
            yield sse(engine_failed(exc).openai_body())
        except ValueError as exc:
            yield sse(bad_request(str(exc)).openai_body())
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-stream, then end cleanly
            logger.exception("stream failed")
            yield sse(APIError(f"Internal server error: {exc!r}", 500).openai_body())
        yield SSE_DONE
