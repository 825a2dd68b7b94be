"""Server-sent events: the framing, templates for text deltas, a streaming response that always
cleans up, and a merge of several streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from json.encoder import encode_basestring as json_string  # a str as a JSON string, like json.dumps(ensure_ascii=False)

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"
TEXT_MARK = "\x00pagedserve:text\x00"  # stands for the text in a chunk given to SSETemplate


def sse(data: dict) -> str:
    """One event: ``data: <compact JSON>`` and a blank line."""
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class SSETemplate:
    """The event of a chunk whose only changing part is one text: all but the text is encoded once.

    ``SSETemplate(chunk)`` takes a chunk holding ``TEXT_MARK`` as exactly one string value;
    ``render(text)`` equals ``sse(chunk with that value replaced by text)``. A stream sends one event
    per token, so the chunk's dict and its JSON encoding are built once per stream, not per token.
    """

    __slots__ = ("_before", "_after")

    def __init__(self, chunk: dict) -> None:
        self._before, self._after = sse(chunk).split(json_string(TEXT_MARK))

    def render(self, text: str) -> str:
        return self._before + json_string(text) + self._after


class SSETemplates(dict):
    """An ``SSETemplate`` per key (a choice index), built from ``make_chunk(key)`` on first use."""

    def __init__(self, make_chunk: Callable[[int], dict]) -> None:
        super().__init__()
        self._make_chunk = make_chunk

    def __missing__(self, key: int) -> SSETemplate:
        template = self[key] = SSETemplate(self._make_chunk(key))
        return template


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response whose generator is closed (aborting its requests) and whose
    ``on_close`` runs however the response ends: completed, client gone, or never started."""

    media_type = "text/event-stream"  # also what /openapi.json declares for a route with this response_class

    def __init__(
        self,
        content: AsyncGenerator[str, None],
        on_close: Callable[[], None] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self._generator = content
        self._on_close: list[Callable[[], None]] = [on_close] if on_close is not None else []

    def add_on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` too once the response ends (after the ones given before)."""
        self._on_close.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._generator.aclose()
            except RuntimeError:
                pass  # still running in a cancelled task; its own cancellation cleans up
            finally:
                callbacks, self._on_close = self._on_close, []
                for callback in callbacks:
                    callback()


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncGenerator[tuple[int, object], None]:
    """Yield ``(i, item)`` from several async iterators as items arrive; close them all at the end."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
    finally:
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:
                    pass
