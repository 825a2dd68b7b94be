"""Route helpers: the JSON content-type check (400), ``with_cancellation``, which cancels a handler
(aborting its requests) when the client disconnects, and ``respond_leased``, which holds a lease until
the response has ended."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, Request
from starlette.responses import Response

from pagedserve.entrypoints.serving.errors import APIError
from pagedserve.entrypoints.serving.sse import SSEResponse


async def respond_leased(release: Callable[[], None], call: Awaitable[Response]) -> Response:
    """Await the handler ``call`` and call ``release`` once its response has ended: after the stream for an
    ``SSEResponse`` (however it ends), else at once (the body is built); also when the handler fails."""
    try:
        response = await call
    except BaseException:
        release()
        raise
    if isinstance(response, SSEResponse):
        response.add_on_close(release)
    else:
        release()
    return response


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancel the handler (aborting its requests) when the client disconnects.

    ``request.is_disconnected()`` does not work behind middleware, so the handler races a task that
    waits for ``http.disconnect``. Streaming responses are watched by Starlette itself once returned.
    """

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        raw_request: Request = kwargs["raw_request"]
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait((handler_task, disconnect_task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect_task.cancel()
        if handler_task in done:
            return handler_task.result()
        handler_task.cancel()
        await asyncio.gather(handler_task, return_exceptions=True)
        return Response(status_code=499)  # never read: the client is gone

    return wrapper


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def validate_json_request(raw_request: Request) -> None:
    media_type = raw_request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError("Unsupported Media Type: Only 'application/json' is allowed", 400, code="unsupported_media_type")


JSON_BODY = [Depends(validate_json_request)]  # the dependencies of every route with a JSON body
