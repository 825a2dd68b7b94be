"""User middleware for the ``--middleware`` tests: each stamps its name on the response."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ORDER_HEADER = "x-middleware-order"


class StampClassMiddleware:
    """A pure-ASGI middleware class: adds ``x-middleware-order: class``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (ORDER_HEADER.encode(), b"class")]
            await send(message)

        await self.app(scope, receive, stamped)


async def stamp_function(request, call_next):
    """An http middleware function: adds ``x-middleware-order: function``."""
    response = await call_next(request)
    response.headers.append(ORDER_HEADER, "function")
    return response


NOT_MIDDLEWARE = 42
