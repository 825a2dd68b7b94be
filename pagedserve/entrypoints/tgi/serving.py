"""TGIServing: TGI's /generate, /generate_stream and /info on AsyncLLM, with TGI's error shapes
(422 validation, 424 generation, 429 overloaded)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from starlette.responses import Response

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import EngineDeadError
from pagedserve.entrypoints.serving.admission import AdmissionControl, check_engine_alive, collect, random_id
from pagedserve.entrypoints.serving.errors import APIError, json_response
from pagedserve.entrypoints.serving.sse import SSEResponse
from pagedserve.entrypoints.tgi.details import TGIDetails, tgi_event
from pagedserve.entrypoints.tgi.protocol import GenerateRequest
from pagedserve.entrypoints.tgi.validation import (
    MAX_BEST_OF,
    MAX_CLIENT_BATCH_SIZE,
    MAX_STOP_SEQUENCES,
    Plan,
    TGIPlanner,
    tgi_error,
)
from pagedserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


class TGIServing:
    """Serves TGI's generate API; the engine and the admission control are shared with the OpenAI routes."""

    def __init__(
        self,
        *,
        engine: AsyncLLM,
        planner: TGIPlanner,
        details: TGIDetails,
        admission: AdmissionControl,
        request_timeout: float | None,
        model_name: str,
        model_dtype: str | None,
    ) -> None:
        self.engine = engine
        self.planner = planner
        self.details = details
        self.admission = admission
        self.request_timeout = request_timeout
        self.model_name = model_name
        self.model_dtype = model_dtype

    def info(self, version: str) -> dict:
        max_model_len = self.planner.limits.max_model_len
        return {
            "model_id": self.model_name,
            "model_sha": None,
            "model_dtype": self.model_dtype,
            "model_device_type": "cpu",
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": self.admission.capacity,
            "max_best_of": MAX_BEST_OF,
            "max_stop_sequences": MAX_STOP_SEQUENCES,
            "max_input_tokens": self.planner.max_input_tokens,
            "max_total_tokens": max_model_len,
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
        body = self.details.generate_body(request, plan, result)
        headers = {"x-prompt-tokens": str(len(plan.token_ids))}
        return json_response([body] if wrap_in_list else body, headers=headers)

    async def generate_stream_response(self, request: GenerateRequest) -> Response:
        plan = await self._plan(request, stream=True)
        self.admission.acquire()
        return SSEResponse(self._stream(request, plan), on_close=self.admission.release)

    async def _plan(self, request: GenerateRequest, stream: bool) -> Plan:
        check_engine_alive(self.engine)
        return await self.planner.plan(request, stream)

    def _generate(self, plan: Plan) -> AsyncGenerator[RequestOutput, None]:
        return self.engine.generate(plan.token_ids, plan.params, random_id("tgi"), prompt=plan.text)

    async def _collect(self, plan: Plan) -> RequestOutput:
        try:
            return await collect(self._generate(plan), self.request_timeout)
        except APIError as exc:
            if exc.status == 500:
                raise tgi_error(exc.message, 424, "generation") from exc
            raise

    async def _stream(self, request: GenerateRequest, plan: Plan) -> AsyncGenerator[str, None]:
        p = request.parameters
        index = 0
        text_parts: list[str] = []
        prefix = request.inputs if p.return_full_text else ""
        try:
            async with asyncio.timeout(self.request_timeout):
                async for output in self._generate(plan):
                    completion = output.outputs[0]
                    text_parts.append(completion.text)
                    for event in self.details.token_events(
                        completion,
                        p,
                        index,
                        output.finished,
                        "".join(text_parts),
                        len(plan.token_ids),
                        plan.seed,
                        prefix,
                    ):
                        index += 1
                        yield event
        except TimeoutError:
            yield tgi_event({"error": f"Request timed out after {self.request_timeout} s", "error_type": "timeout"})
        except (EngineDeadError, ValueError) as exc:
            yield tgi_event({"error": f"Request failed during generation: {exc}", "error_type": "generation"})
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-stream
            logger.exception("stream failed")
            yield tgi_event({"error": f"Incomplete generation: {exc!r}", "error_type": "incomplete_generation"})
