"""OpenAIServingChat: POST /v1/chat/completions: chat template -> tokens -> generate -> message or SSE."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.responses import Response

from pagedserve.engine.core_client import EngineDeadError
from pagedserve.entrypoints.openai.formatting import chat_logprobs, prompt_logprobs_json, usage
from pagedserve.entrypoints.openai.handler_parts import GenerationParts
from pagedserve.entrypoints.openai.prompts import PreparedPrompt
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.request_checks import check_generation_request
from pagedserve.entrypoints.openai.tool_calls import ToolCallingOptions, ToolPlan, ToolStream, plan_tools
from pagedserve.entrypoints.serving.admission import collect, engine_failed, random_id, timeout_error
from pagedserve.entrypoints.serving.errors import APIError, bad_request, json_response
from pagedserve.entrypoints.serving.sse import SSE_DONE, TEXT_MARK, SSEResponse, SSETemplates, sse
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class OpenAIServingChat:
    """Checks a chat request, applies the chat template, runs it and answers with a message or an SSE stream."""

    def __init__(self, parts: GenerationParts, tool_options: ToolCallingOptions | None = None) -> None:
        self.parts = parts
        self.tool_options = tool_options or ToolCallingOptions()

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        model_name = check_generation_request(request, self.parts.models, self.parts.engine)
        tools = plan_tools(request, self.tool_options)
        num_top = self._check_chat_logprobs(request)
        self.parts.sampling.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        constraint = await self.parts.structured.parse_and_check(request)
        schema = tools.constraint_schema() if tools is not None else None
        if schema is not None:
            if constraint is not None:
                raise bad_request("response_format cannot be combined with a required or named tool_choice.", "tools")
            constraint = StructuredOutputsParams(json=self.parts.structured.schema_text(schema, "tools"))
            await self.parts.structured.check(constraint, "tools", kind="tools")
        prompt = await self.parts.prompts.chat_prompt(request, tools.prompt_tools if tools is not None else None)
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens = self.parts.sampling.resolve_max_tokens(len(prompt.token_ids), requested, None)
        params = self.parts.sampling.build(request, max_tokens, num_top, request.prompt_logprobs, constraint)
        request_id = random_id("chatcmpl")
        self.parts.admission.acquire()
        if request.stream:
            stream = self._stream(request, request_id, model_name, prompt, params, num_top, tools)
            return SSEResponse(stream, on_close=self.parts.admission.release)
        try:
            result = await collect(self.parts.generate(prompt, params, request_id, request), self.parts.request_timeout)
        finally:
            self.parts.admission.release()
        echo = _echo_text(request)
        choices = []
        for completion in sorted(result.outputs, key=lambda c: c.index):
            finish = completion.finish_reason.value if completion.finish_reason else None
            content: str | None = echo + completion.text
            calls = []
            if tools is not None:
                content, calls = tools.calls_of(completion.text)
                finish = tools.finish_reason(finish, len(calls))
                content = echo + content if content is not None else (echo or None)
            choices.append(
                {
                    "index": completion.index,
                    "message": {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [call.to_openai() for call in calls],
                    },
                    "logprobs": chat_logprobs(self.parts.texts, completion.token_ids, completion.logprobs, num_top)
                    if num_top is not None
                    else None,
                    "finish_reason": finish,
                    "stop_reason": completion.stop_reason,
                }
            )
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(
                len(prompt.token_ids), sum(len(c.token_ids) for c in result.outputs), result.num_cached_tokens
            ),
        }
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(self.parts.texts, prompt.token_ids, result.prompt_logprobs)
        return json_response(body)

    def _check_chat_logprobs(self, request: ChatCompletionRequest) -> int | None:
        """The number of top logprobs to return per token, or None when logprobs are off."""
        top = request.top_logprobs
        if top is not None:
            if top < 0:
                raise bad_request("`top_logprobs` must be a non-negative value.", "top_logprobs")
            if top > 0 and not request.logprobs:
                raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
            self.parts.sampling.check_logprobs(top, "top_logprobs")
        return (top or 0) if request.logprobs else None

    # ----------------------------------------------------------------- streaming
    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        prompt: PreparedPrompt,
        params: SamplingParams,
        num_top: int | None,
        tools: ToolPlan | None = None,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        streams = {index: tools.streamer() for index in range(request.n)} if tools is not None else None
        # a tool-call stream may hold text back (a call not yet complete): its tokens' logprobs wait with it
        pending_logprobs: dict[int, list[dict]] = {index: [] for index in range(request.n)}
        texts = self.parts.texts
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name}
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = include_usage and bool(request.stream_options.continuous_usage_stats)
        num_prompt_tokens = len(prompt.token_ids)
        num_generated = 0
        num_cached = 0
        echo = _echo_text(request)
        plain_events = SSETemplates(
            lambda index: {
                **head,
                "choices": [  # per choice index: a content delta only
                    {"index": index, "delta": {"content": TEXT_MARK}, "logprobs": None, "finish_reason": None}
                ],
            }
        )
        try:
            for index in range(request.n):
                yield sse(
                    {
                        **head,
                        "choices": [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
                if echo:
                    yield sse(
                        {
                            **head,
                            "choices": [
                                {"index": index, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
                            ],
                        }
                    )
            async with asyncio.timeout(self.parts.request_timeout):
                async for output in self.parts.generate(prompt, params, request_id, request):
                    num_cached = output.num_cached_tokens
                    for completion in output.outputs:
                        num_generated += len(completion.token_ids)
                        finish = completion.finish_reason
                        if streams is not None:
                            if num_top is not None:
                                pending_logprobs[completion.index] += chat_logprobs(
                                    texts, completion.token_ids, completion.logprobs, num_top
                                )["content"]
                            for chunk in _tool_stream_chunks(head, streams[completion.index], completion, tools):
                                choice = chunk["choices"][0]
                                if num_top is not None:  # held tokens' logprobs ride on their choice's next chunk
                                    choice["logprobs"] = {"content": pending_logprobs[completion.index]}
                                    pending_logprobs[completion.index] = []
                                if continuous:
                                    chunk["usage"] = usage(num_prompt_tokens, num_generated, None)
                                yield sse(chunk)
                            continue
                        has_logprobs = num_top is not None and completion.token_ids
                        if not completion.text and finish is None and not has_logprobs:
                            continue
                        if finish is None and num_top is None and not continuous:
                            yield plain_events[completion.index].render(completion.text)
                            continue
                        choice = {
                            "index": completion.index,
                            "delta": {"content": completion.text} if completion.text or finish is None else {},
                            "logprobs": chat_logprobs(texts, completion.token_ids, completion.logprobs, num_top)
                            if num_top is not None
                            else None,
                            "finish_reason": finish.value if finish else None,
                        }
                        if finish is not None:
                            choice["stop_reason"] = completion.stop_reason
                        chunk = {**head, "choices": [choice]}
                        if continuous:
                            chunk["usage"] = usage(num_prompt_tokens, num_generated, None)
                        yield sse(chunk)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(num_prompt_tokens, num_generated, num_cached)})
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


def _tool_stream_chunks(head: dict, stream: ToolStream, completion: Any, tools: ToolPlan) -> list[dict]:
    """The chunks of one choice's new output when tools are in play: content and tool-call deltas, then
    the finish chunk (``tool_calls`` when calls were sent)."""
    index = completion.index
    deltas = [stream.feed(completion.text)]
    finish = completion.finish_reason
    if finish is not None:
        deltas.append(stream.finish())
    chunks = []
    for delta in deltas:
        body: dict[str, Any] = {}
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = [piece.to_openai() for piece in delta.tool_calls]
        if body:
            chunks.append(
                {**head, "choices": [{"index": index, "delta": body, "logprobs": None, "finish_reason": None}]}
            )
    if finish is not None:
        reason = tools.finish_reason(finish.value, stream.num_calls)
        choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        choice["stop_reason"] = completion.stop_reason
        chunks.append({**head, "choices": [choice]})
    return chunks


def _echo_text(request: ChatCompletionRequest) -> str:
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    if last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content)
