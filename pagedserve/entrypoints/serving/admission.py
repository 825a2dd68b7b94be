"""Admission control (a bounded queue: 429 once it is full), the live-engine check (503) and running a
request to completion under the per-request timeout (408), with engine failures as 500s."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import EngineDeadError
from pagedserve.entrypoints.serving.errors import APIError, bad_request, param_from_message
from pagedserve.outputs import RequestOutput


@dataclass(slots=True)
class AdmissionControl:
    """Bounded queue: refuses (429) once in-flight requests exceed running capacity + queue limit."""

    capacity: int | None
    retry_after_s: int = 1
    on_reject: Callable[[str], None] | None = None
    in_flight: int = 0

    def acquire(self, count: int = 1) -> None:
        if self.capacity is not None and self.in_flight + count > self.capacity:
            if self.on_reject is not None:
                self.on_reject("overloaded")
            raise APIError(
                "The server is overloaded: too many requests are queued. Please retry later.",
                429,
                code="server_overloaded",
                type="overloaded_error",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += count

    def release(self, count: int = 1) -> None:
        self.in_flight = max(0, self.in_flight - count)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_engine_alive(engine: AsyncLLM) -> None:
    if engine.is_dead:
        raise APIError("The engine is not running.", 503, code="engine_dead", type="service_unavailable")


def timeout_error(seconds: float | None) -> APIError:
    return APIError(
        f"The request timed out after {seconds} s and was aborted.", 408, code="request_timeout", type="timeout_error"
    )


def engine_failed(exc: BaseException) -> APIError:
    return APIError(f"The engine failed: {exc}", 500, type="internal_server_error")


async def collect(stream: AsyncGenerator[RequestOutput, None], timeout: float | None) -> RequestOutput:
    """Run a request to completion, merging its deltas into one output (``timeout`` seconds at most)."""
    final: RequestOutput | None = None
    try:
        async with asyncio.timeout(timeout):
            async for output in stream:
                if final is None:
                    final = output
                else:
                    final.merge_delta(output)
    except TimeoutError as exc:
        raise timeout_error(timeout) from exc
    except EngineDeadError as exc:
        raise engine_failed(exc) from exc
    except ValueError as exc:
        raise bad_request(str(exc), param_from_message(str(exc))) from exc
    assert final is not None
    return final
